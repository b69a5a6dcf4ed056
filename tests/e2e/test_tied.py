"""Tied embeddings (Qwen3-0.6B ties its LM head to the input embedding): FSDP2 at 2 ranks keeps
the tie through sharded loading and training, resume is exact, and the export is a tied Hugging
Face model with the trained logits, as are the weights external RL publishes. One torchrun
launch (tests/e2e/tied_resume_loop.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from fnt.export import export_hf
from fnt.sharded_load import SafetensorsDir
from tests.e2e.helpers import model_weights, run_script
from tests.e2e.tied_resume_loop import PROBE, K, N

LOOP = str(Path(__file__).resolve().parent / "tied_resume_loop.py")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def test_tied_two_ranks_resume_exactly_and_export_tied(tiny_tied_dir, tmp_path):
    assert HEAD not in SafetensorsDir(tiny_tied_dir)  # the files hold the embedding only
    run_script(LOOP, str(tmp_path), str(tiny_tied_dir), nproc=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["tied_at_start"] and report["tied_after_training"], report
        assert report["resumed_from"] == K
        # Bit-equal losses and grad norms after the resume (floats through JSON are exact).
        assert report["resumed"] == report["full"][K:], report
    assert reports[0]["full"][0][0] != reports[0]["full"][-1][0]  # it did train

    full = model_weights(tmp_path / "full" / "checkpoints" / f"step_{N}", tmp_path)
    resumed = model_weights(tmp_path / "resumed" / "checkpoints" / f"step_{N}", tmp_path)
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    base = AutoModelForCausalLM.from_pretrained(tiny_tied_dir).state_dict()
    assert not torch.equal(full[EMBED], base[EMBED])
    assert torch.equal(full.get(HEAD, full[EMBED]), full[EMBED])

    hf = export_hf(tmp_path / "full" / "checkpoints" / f"step_{N}", tmp_path / "hf")
    assert HEAD not in SafetensorsDir(hf)  # no duplicate of the shared tensor
    exported = AutoModelForCausalLM.from_pretrained(hf)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert torch.equal(exported.model.embed_tokens.weight, full[EMBED])
    trained_logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        got = exported(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)

    # External RL's published weights: gathered from the shards, one copy per name, yet tied.
    published = tmp_path / "published" / "weights" / f"step_{N}"
    assert HEAD not in SafetensorsDir(published)
    policy = AutoModelForCausalLM.from_pretrained(published)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    with torch.no_grad():
        got = policy(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)
