"""Tied embeddings (Qwen3-0.6B ties its LM head to the input embedding): FSDP2 at 2 ranks keeps
the tie through sharded loading and training, resume is exact, and the export is a tied Hugging
Face model with the trained logits, as are the weights external RL publishes. One torchrun
launch (tests/e2e/tied_resume_loop.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.apps.export import export_hf_
from fnt.model.sharded_load import SafetensorsDir
from tests.e2e.helpers import model_weights
from tests.e2e.tied_resume_loop import PROBE, K, N

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_job(fixture, out):
    return {
        "call": "tests.e2e.tied_resume_loop:main",
        "args": [str(out), str(fixture("tiny_tied_dir"))],
    }


@pytest.mark.numerics
@pytest.mark.two_ranks(job=tied_job)
def test_tied_two_ranks_resume_exactly_and_export_tied(tiny_tied_dir, two_rank_runs, tmp_path):
    assert HEAD not in SafetensorsDir(tiny_tied_dir)  # the files hold the embedding only
    run = two_rank_runs(tied_job)
    reports = [json.loads((run / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["tied_at_start"] and report["tied_after_training"], report
        assert report["resumed_from"] == K
        # Bit-equal losses and grad norms after the resume (floats through JSON are exact).
        assert report["resumed"] == report["full"][K:], report
    assert reports[0]["full"][0][0] != reports[0]["full"][-1][0]  # it did train

    full = model_weights(run / "full" / "checkpoints" / f"step_{N}", tmp_path)
    resumed = model_weights(run / "resumed" / "checkpoints" / f"step_{N}", tmp_path)
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    base = AutoModelForCausalLM.from_pretrained(tiny_tied_dir).state_dict()
    assert not torch.equal(full[EMBED], base[EMBED])
    assert torch.equal(full.get(HEAD, full[EMBED]), full[EMBED])

    hf = export_hf_(run / "full" / "checkpoints" / f"step_{N}", tmp_path / "hf")
    assert HEAD not in SafetensorsDir(hf)  # no duplicate of the shared tensor
    exported = AutoModelForCausalLM.from_pretrained(hf)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert torch.equal(exported.model.embed_tokens.weight, full[EMBED])
    trained_logits = torch.load(run / "logits.pt")
    with torch.no_grad():
        got = exported(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)

    # External RL's published weights: gathered from the shards, one copy per name, yet tied.
    published = run / "published" / "weights" / f"step_{N}"
    assert HEAD not in SafetensorsDir(published)
    policy = AutoModelForCausalLM.from_pretrained(published)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    with torch.no_grad():
        got = policy(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)
