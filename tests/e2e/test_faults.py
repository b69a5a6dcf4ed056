"""SIGKILL at every fault point of fnt.faults, and at random moments: the resumed run has rows
1..N exactly once and equals an uninterrupted run bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from fnt.faults import parse_fault
from fnt.testing import WANDB_STUB
from tests.e2e.helpers import (
    REPO,
    TORCHRUN,
    assert_resumed_run_matches,
    config_args,
    read_metrics,
    run_fnt,
    run_killed,
    run_script,
)

pytestmark = pytest.mark.numerics

N = 6
# Every row value a deterministic step produces (timings and dates differ between runs).
EXACT_KEYS = (
    "loss/mean",
    "optim/grad_norm",
    "optim/lr",
    "progress/num_samples",
    "progress/num_tokens",
)
# Saves at 2, 4, 6 with only the newest kept, so that a save's cleanup deletes a checkpoint.
SAVES = ("--ckpt.interval", "2", "--ckpt.keep-last", "1")
# A W&B that answers at once, for the fault inside W&B's log call (no account, no files).
FAST_WANDB = {
    "PYTHONPATH": f"{WANDB_STUB}:{REPO}",
    "SLOW_WANDB_LOG_SECONDS": "0",
}


def args(model_dir, out, *extra, steps=N):
    return config_args(
        "examples/debug/sft.toml", model_dir, out, "--max-steps", str(steps), *SAVES, *extra
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    def run(nproc):
        out = tmp_path_factory.mktemp(f"uninterrupted{nproc}") / "run"
        run_fnt("sft", *args(tiny_model_dir, out), nproc=nproc)
        return out

    return run


FAULTS = [
    pytest.param("step@5", 0, id="after-the-update-before-the-row", marks=pytest.mark.slow),
    pytest.param("row@4", 0, id="after-the-row-before-the-checkpoint"),
    pytest.param("wandb@3", 0, id="inside-wandb-log", marks=pytest.mark.slow),
    # The save phases at 1 rank are in test_resume.py; here the other rank dies.
    pytest.param("shards@4:1", 2, id="rank1-shards", marks=pytest.mark.slow),
    pytest.param("step@5:1", 2, id="rank1-after-the-update", marks=pytest.mark.slow),
    pytest.param("row@4:1", 2, id="rank1-after-the-row", marks=pytest.mark.slow),
    pytest.param("committed@4", 2, id="rank0-committed", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fault, nproc", FAULTS)
def test_a_kill_at_any_fault_point_resumes_to_every_row_once(
    tiny_model_dir, tmp_path, uninterrupted, fault, nproc
):
    reference = uninterrupted(nproc)
    out = tmp_path / "run"
    extra = ("--wandb.mode", "offline") if parse_fault(fault).phase == "wandb" else ()
    env = FAST_WANDB if extra else {}
    run_killed(*args(tiny_model_dir, out, *extra), fault=fault, nproc=nproc, env=env)
    # The stub W&B package is found through the child's PYTHONPATH (env).
    run_fnt("sft", *args(tiny_model_dir, out, *extra, "--resume", "latest"), nproc=nproc, env=env)
    assert_resumed_run_matches(reference, out, 0, N, EXACT_KEYS, tmp_path)


def _last_row_step(out) -> int:
    try:
        return max((row["step"] for row in read_metrics(out)), default=0)
    except (OSError, ValueError):  # not there yet, or a line being written
        return 0


def _run_until_killed(command, out, kill_after_step: int, jitter_s: float, timeout: float):
    """Start `command`; SIGKILL its whole process group once row `kill_after_step` is on disk
    and `jitter_s` more seconds have passed (inside a later step or a save). True if killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while child.poll() is None:
            if _last_row_step(out) >= kill_after_step:
                time.sleep(jitter_s)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return True
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.005)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == 0, child.stderr.read().decode()[-3000:]
    return False


LORA = ("--model.lora.rank", "8", "--model.lora.dropout", "0.1")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, kills, steps, extra",
    # LoRA at one rank: tests/e2e/test_lora.py kills a save; here the two-rank case, the harder.
    # Each kill restarts a run (a torchrun start at two ranks), so CI time limits their number.
    [(0, 6, 20, ()), (2, 5, 16, ()), (2, 3, 12, LORA)],
    ids=["1rank", "2ranks", "2ranks-lora"],
)
def test_kills_at_random_moments_resume_to_the_uninterrupted_run(
    tiny_model_dir, tmp_path, nproc, kills, steps, extra
):
    reference = tmp_path / "reference"
    run_script("sft.py", *args(tiny_model_dir, reference, *extra, steps=steps), nproc=nproc)

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    out = tmp_path / "run"
    launcher = [*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    done = 0
    # Kill points move forward through the run; each restart resumes from the latest checkpoint.
    for kill_after in sorted(rng.sample(range(1, steps - 1), kills)):
        command = [
            *launcher,
            str(REPO / "scripts" / "sft.py"),
            *args(tiny_model_dir, out, *extra, "--resume", "latest", steps=steps),
        ]
        killed = _run_until_killed(command, out, kill_after, rng.uniform(0, 0.1), timeout=300)
        assert killed, f"seed {seed}: the run ended before its kill after step {kill_after}"
        done += 1
    resume = args(tiny_model_dir, out, *extra, "--resume", "latest", steps=steps)
    run_script("sft.py", *resume, nproc=nproc)
    assert done == kills
    assert_resumed_run_matches(reference, out, 0, steps, EXACT_KEYS, tmp_path)
