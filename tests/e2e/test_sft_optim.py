"""scripts/sft.py with the CPU AdamW: exact resume, and FSDP2 offload policies under torchrun."""

from __future__ import annotations

import math
import shutil

import pytest

from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
    run_script,
)
from tests.e2e.test_resume import EXACT_KEYS

pytestmark = pytest.mark.numerics

N, K = 6, 3


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


def losses(out) -> list[float]:
    return [row["loss/mean"] for row in read_metrics(out)]


NATIVE = ("--optim.impl", "native")
# keep_fp32 makes each gate_proj an FSDP2 unit of its own inside its decoder layer's unit.
FULL_FP32 = (
    *("--optim.offload", "full", "--optim.offload-dtype", "float32"),
    *("--optim.keep-fp32", '["mlp.gate_proj"]'),
)


@pytest.fixture(scope="module")
def native_run(tiny_model_dir, tmp_path_factory):
    """N steps with a checkpoint every K, one process. Its losses equal torch.optim.AdamW's
    within 1e-5 (tests/native/test_offload.py checks that in-process, over 20 steps)."""
    out = tmp_path_factory.mktemp("native") / "run"
    run_cli("sft", *args(tiny_model_dir, out, "--ckpt.interval", str(K), *NATIVE))
    return out


def test_native_k_steps_then_resume_equals_n_steps(tiny_model_dir, tmp_path, native_run):
    full = native_run
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    run_cli("sft", *args(tiny_model_dir, resumed, "--resume", "latest", *NATIVE))
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)


@pytest.mark.slow
def test_two_ranks_offload_full_then_state_match_one_rank(tiny_model_dir, tmp_path, native_run):
    # FSDP2 with CPUOffloadPolicy and a float32 MixedPrecisionPolicy on a CPU gloo mesh, saved
    # at K and resumed with offload state (no mixed-precision policy): the same training.
    full = tmp_path / "full"
    run_script(
        "sft.py",
        *args(tiny_model_dir, full, "--ckpt.interval", str(K), *NATIVE, *FULL_FP32),
        nproc=2,
    )
    assert losses(full) == pytest.approx(losses(native_run), abs=1e-5, rel=0)

    state = tmp_path / "state"
    shutil.copytree(full / "checkpoints" / f"step_{K}", state / "checkpoints" / f"step_{K}")
    shutil.copy(full / "metrics.jsonl", state / "metrics.jsonl")
    run_script(
        "sft.py",
        *args(tiny_model_dir, state, "--resume", "latest", *NATIVE, "--optim.offload", "state"),
        nproc=2,
    )
    assert [r["step"] for r in read_metrics(state)] == list(range(1, N + 1))
    assert losses(state) == pytest.approx(losses(native_run), abs=1e-5, rel=0)


@pytest.mark.gpu
def test_one_cuda_rank_trains_with_full_offload_in_bfloat16(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_script(
        "sft.py",
        *args(tiny_model_dir, out, *NATIVE, "--optim.offload", "full"),
        nproc=1,
    )
    values = losses(out)
    assert all(math.isfinite(v) for v in values) and values[-1] < values[0], values
