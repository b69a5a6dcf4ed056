"""Exported Hugging Face directories reproduce the trained model, and replace only what an
export wrote."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt.checkpoint import save_checkpoint_
from fnt.data.synthetic import synthetic_rows
from fnt.loop import fold
from fnt.store.transaction import written_by
from steps.sft import sft_step
from tests.e2e.helpers import run_cli, run_script
from tests.steps.test_sft import batch_of, make_state


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A model trained 3 steps in process, its checkpoint, and its logits on a probe batch."""
    state = make_state(tiny_model_dir)
    rows, _ = synthetic_rows(seed=5, step=1, num_rows=4, seq_len=32)
    for state, _ in fold(state, lambda _: batch_of(rows, 2), sft_step, 3):
        pass
    root = tmp_path_factory.mktemp("export") / "checkpoints"
    ckpt = save_checkpoint_(
        root,
        state.progress,
        state.handles.model,
        state.handles.optimizer,
        model_name=str(tiny_model_dir),
        rank=0,
        distributed=False,
    )
    probe = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = state.handles.model(input_ids=probe).logits
    return ckpt, probe, logits, state.handles.model


def test_float32_export_has_the_trained_logits(trained, tmp_path):
    ckpt, probe, logits, _ = trained
    run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=probe).logits, logits, rtol=0, atol=1e-6)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template


def test_bfloat16_export_is_the_rounded_trained_model(trained, tmp_path):
    ckpt, probe, logits, model = trained
    run_cli(
        "export",
        "--checkpoint",
        str(ckpt),
        "--out",
        str(tmp_path / "hf"),
        "--dtype",
        "bfloat16",
    )
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    trained_weights = dict(model.named_parameters())
    for name, p in exported.named_parameters():
        assert torch.equal(p, trained_weights[name].detach().to(torch.bfloat16)), name
    with torch.no_grad():
        got = exported(input_ids=probe).logits.float()
    torch.testing.assert_close(got, logits, rtol=0.05, atol=0.1)


@pytest.mark.slow  # 2-rank export is also in tests/e2e/test_tied.py
def test_a_two_rank_checkpoint_exports(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_script(
        "sft.py",
        "--config",
        "examples/debug/sft.toml",
        "--model.name",
        str(tiny_model_dir),
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        nproc=2,
    )
    ckpt = out / "checkpoints" / "step_1"
    assert len(list(ckpt.glob("*.distcp"))) == 2
    run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [
        n
        for n, p in exported.named_parameters()
        if not torch.equal(p, dict(base.named_parameters())[n])
    ]
    assert len(changed) == len(list(base.parameters()))  # every tensor was trained and exported


def test_an_export_replaces_an_earlier_export_and_anything_else_only_with_force(trained, tmp_path):
    """An earlier export is replaced without asking (its COMPLETE marker names `fnt export`);
    someone else's directory is refused, its files unchanged, until --force."""
    ckpt, _, _, _ = trained
    out = tmp_path / "hf"
    run_cli("export", "--checkpoint", str(ckpt), "--out", str(out))
    assert written_by(out) == "fnt export"
    run_cli("export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "bfloat16")
    assert json.loads((out / "COMPLETE").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused = run_cli("export", "--checkpoint", str(ckpt), "--out", str(mine), check=False)
    assert refused.returncode == 2 and "notes.txt" in refused.stderr and "--force" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    run_cli("export", "--checkpoint", str(ckpt), "--out", str(mine), "--force")
    assert not (mine / "notes.txt").exists() and written_by(mine) == "fnt export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no .partial left
