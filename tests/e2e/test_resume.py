"""Resume is exact and checkpoints are transactions: real runs, real crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fnt.checkpoint import FAULT_ENV
from fnt.monitors import read_metrics
from fnt.resume import resolve_resume_step
from tests.e2e.helpers import (
    REPO,
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    run_script,
)

N, K = 6, 3
EXACT_KEYS = (
    "loss/mean",
    "optim/grad_norm",
    "optim/lr",
    "progress/num_samples",
    "progress/num_tokens",
)


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


@pytest.mark.parametrize("nproc", [0, 2], ids=["1rank", "2ranks"])
def test_k_steps_then_resume_equals_n_steps(tiny_model_dir, tmp_path, nproc):
    full = tmp_path / "full"
    run_script("sft.py", *args(tiny_model_dir, full, "--ckpt.interval", str(K)), nproc=nproc)

    # A crashed run: its checkpoint at K, and metrics rows it had written beyond K.
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    run_script("sft.py", *args(tiny_model_dir, resumed, "--resume", "latest"), nproc=nproc)
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)


@pytest.mark.parametrize("phase", ["shards", "marker"])
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(
    tiny_model_dir, tmp_path, phase
):
    out = tmp_path / "run"
    env = {**os.environ, FAULT_ENV: f"4:{phase}"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "sft.py"),
            *args(tiny_model_dir, out, "--ckpt.interval", "2"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_4.partial").is_dir()  # the save really was under way
    assert resolve_resume_step("latest", out / "checkpoints") == 2

    run_script("sft.py", *args(tiny_model_dir, out, "--ckpt.interval", "2", "--resume", "latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    assert resolve_resume_step("latest", out / "checkpoints") == N
    assert not (out / "checkpoints" / "step_4.partial").exists()
