"""Resume is exact and checkpoints are transactions: real runs, real crashes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fnt.checkpoint import FAULT_ENV
from fnt.monitors import read_metrics
from fnt.resume import resolve_resume_step
from tests.e2e.helpers import REPO, config_args, run_script

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


def model_weights(ckpt_dir, tmp_path) -> dict[str, torch.Tensor]:
    target = tmp_path / f"{ckpt_dir.parent.parent.name}_{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, target)
    state = torch.load(target, weights_only=False)
    return state["model"]


@pytest.mark.parametrize("nproc", [0, 2], ids=["1rank", "2ranks"])
def test_k_steps_then_resume_equals_n_steps(tiny_model_dir, tmp_path, nproc):
    full = tmp_path / "full"
    run_script("sft.py", *args(tiny_model_dir, full, "--ckpt.interval", str(K)), nproc=nproc)

    # A crashed run: its checkpoint at K, and metrics rows it had written beyond K.
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / f"step_{K}", resumed / "checkpoints" / f"step_{K}")
    shutil.copy(full / "metrics.jsonl", resumed / "metrics.jsonl")
    run_script("sft.py", *args(tiny_model_dir, resumed, "--resume", "latest"), nproc=nproc)

    rows_full, rows_resumed = read_metrics(full), read_metrics(resumed)
    assert [r["step"] for r in rows_resumed] == list(range(1, N + 1))
    for a, b in zip(rows_full[K:], rows_resumed[K:]):
        for key in EXACT_KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    w_full = model_weights(full / "checkpoints" / f"step_{N}", tmp_path)
    w_resumed = model_weights(resumed / "checkpoints" / f"step_{N}", tmp_path)
    assert w_full.keys() == w_resumed.keys()
    for name in w_full:
        assert torch.equal(w_full[name], w_resumed[name]), name


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
