"""bfloat16 compute over float32 parameters (`model.compute_dtype`): it tracks the float32 run,
keeps float32 masters and checkpoints, resumes exactly, and switches to float32 and back."""

from __future__ import annotations

import math

import pytest
import torch

from fnt import Config, ModelConfig, fold, init_state, setup_trainer, sft_source, to_floats
from fnt.config import OptimConfig
from steps import sft_step
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    model_weights,
    read_metrics,
    run_cli,
    run_script,
)

# bf16 has an 8-bit mantissa: over 20 steps of the tiny model the losses stay this close.
TRACKING_TOLERANCE = 5e-3
N, K = 6, 3
BF16 = ("--model.compute-dtype", "bfloat16")


def losses(model_dir, compute_dtype: str, steps: int = 20) -> tuple[list[float], object]:
    config = Config(
        model=ModelConfig(name=str(model_dir), compute_dtype=compute_dtype),
        optim=OptimConfig(lr=3e-3),
        seq_len=64,
        batch_size=4,
        micro_batch_size=2,
    )
    state = init_state(config, setup_trainer(config))
    out = [to_floats(m)["loss/mean"] for state, m in fold(state, sft_source, sft_step, steps)]
    return out, state


def test_bf16_compute_tracks_fp32_and_keeps_float32_masters(tiny_model_dir):
    fp32, _ = losses(tiny_model_dir, "float32")
    bf16, state = losses(tiny_model_dir, "bfloat16")
    assert fp32 != bf16  # the compute really was in bfloat16
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < TRACKING_TOLERANCE
    assert bf16[-1] < 0.7 * bf16[0]
    optimizer = state.handles.optimizer
    for p in state.handles.model.parameters():
        assert p.dtype == torch.float32
        assert all(t.dtype == torch.float32 for t in optimizer.state[p].values() if t.dim())


def sft_args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


@pytest.mark.slow
def test_bf16_compute_at_two_ranks_tracks_fp32_and_resumes_exactly(tiny_model_dir, tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    run_script("sft.py", *sft_args(tiny_model_dir, fp32), nproc=2)
    run_script("sft.py", *sft_args(tiny_model_dir, bf16, "--ckpt.interval", str(K), *BF16), nproc=2)
    pairs = zip(read_metrics(fp32), read_metrics(bf16))
    assert all(abs(a["loss/mean"] - b["loss/mean"]) < TRACKING_TOLERANCE for a, b in pairs)
    weights = model_weights(bf16 / "checkpoints" / f"step_{N}", tmp_path)
    assert all(t.dtype == torch.float32 for t in weights.values())

    resumed = tmp_path / "resumed"
    copy_crashed_run(bf16, resumed, K)
    run_script("sft.py", *sft_args(tiny_model_dir, resumed, "--resume", "latest", *BF16), nproc=2)
    assert_resumed_run_matches(bf16, resumed, K, N, ("loss/mean", "optim/grad_norm"), tmp_path)


@pytest.mark.parametrize("first", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_a_run_switches_compute_dtype_on_resume(tiny_model_dir, tmp_path, first):
    second = "float32" if first == "bfloat16" else "bfloat16"
    out = tmp_path / "run"
    run_cli(
        "sft",
        *sft_args(tiny_model_dir, out, "--max-steps", str(K), "--model.compute-dtype", first),
    )
    saved = model_weights(out / "checkpoints" / f"step_{K}", tmp_path)
    run_cli(
        "sft",
        *sft_args(tiny_model_dir, out, "--resume", "latest", "--model.compute-dtype", second),
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    assert all(math.isfinite(r["loss/mean"]) for r in rows)
    assert rows[-1]["loss/mean"] < rows[0]["loss/mean"]
    assert all(t.dtype == torch.float32 for t in saved.values())
