"""A preemption's grace period: a step that hangs after SIGTERM (a reward function stuck in step
3) ends the run after runtime.preempt_grace_s, or at once on a second signal, with the
preemption's exit status and one line naming the step; nothing is half-written, and the
previous checkpoint resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnt.resume import resolve_resume_step
from fnt.store.rundir import METRICS_FILE
from tests.e2e.helpers import (
    REPO,
    TORCHRUN,
    assert_resumed_run_matches,
    config_args,
    read_metrics,
    run_cli,
)
from tests.e2e.test_preemption import children, wait_for_rows

STEPS = 6
# 2 prompts x 4 completions per step: the 17th reward call of the steps is step 3's first.
HANG_AFTER_CALLS = 16
# Each rank's start-up trial (fnt.apps.preflight.try_user_code) calls the reward once first.
TRIAL_CALLS = 1
EXACT_KEYS = ("loss/mean", "optim/grad_norm", "reward/mean")


def rl_args(model_dir, out: Path, *extra: str) -> tuple[str, ...]:
    return config_args(
        "examples/debug/rl.toml",
        model_dir,
        out,
        *("--max-steps", str(STEPS), "--ckpt.interval", "1"),
        *("--rollout.reward", "tests.e2e.hanging_reward:reward", *extra),
    )


def signalled_run(args, out: Path, delays: list[float], nproc: int = 0, hang_rank: int = 0):
    """Run scripts/rl.py with a reward that hangs in step 3; once row 2 is written, send SIGTERM
    after each of `delays` (seconds after the previous signal): to the process, or under
    torchrun to the launcher, which forwards it to every worker. Returns the finished process,
    its stdout and stderr, and the seconds from the first signal to its exit."""
    launcher = [*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HANG_AFTER_CALLS": str(HANG_AFTER_CALLS // max(1, nproc) + TRIAL_CALLS),
        "HANG_RANK": str(hang_rank),
    }
    with subprocess.Popen(
        [*launcher, str(REPO / "scripts" / "rl.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            wait_for_rows(out / METRICS_FILE, 2, proc)
            time.sleep(0.5)  # step 3 is under way, and hangs
            first = None
            for delay in delays:
                time.sleep(delay)
                os.kill(proc.pid, signal.SIGTERM)
                first = first or time.monotonic()
            stdout, stderr = proc.communicate(timeout=120)
            elapsed = time.monotonic() - first
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc, stdout, stderr, elapsed


def assert_ended_in_step_3_with_step_2_as_the_resume_point(out: Path, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-4000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert resolve_resume_step("latest", out / "checkpoints") == 2
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert leftovers == ["step_1", "step_2"], leftovers


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grace") / "full"
    run_cli("rl", *rl_args(tiny_model_dir, out))
    return out


@pytest.mark.parametrize(
    ("grace", "delays", "why"),
    [
        ("2", [0.0], "preempted by SIGTERM: step 3 did not end within runtime.preempt_grace_s"),
        pytest.param(
            "600",
            [0.0, 1.0],
            "preempted by SIGTERM: a second SIGTERM during step 3",
            marks=pytest.mark.slow,  # the default suite's time: grace-expires ends it the same way
        ),
    ],
    ids=["grace-expires", "second-signal"],
)
def test_a_step_that_hangs_after_sigterm_ends_the_run_and_the_last_checkpoint_resumes_exactly(
    tiny_model_dir, tmp_path, full_run, grace, delays, why
):
    out = tmp_path / "run"
    proc, _, stderr, elapsed = signalled_run(
        rl_args(tiny_model_dir, out, "--runtime.preempt-grace-s", grace), out, delays
    )
    assert proc.returncode == 143, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.startswith("preempted by")]
    assert len(lines) == 1 and lines[0].startswith(why), stderr[-4000:]
    assert elapsed < sum(delays) + float(grace if len(delays) == 1 else 0) + 5, elapsed
    assert_ended_in_step_3_with_step_2_as_the_resume_point(out, stderr)
    run_cli("rl", *rl_args(tiny_model_dir, out, "--resume", "latest"))
    assert_resumed_run_matches(full_run, out, 2, STEPS, EXACT_KEYS, tmp_path)


@pytest.mark.slow
def test_at_two_ranks_a_hung_rank_and_the_rank_waiting_for_it_both_exit_after_the_grace(
    tiny_model_dir, tmp_path
):
    """Rank 0 hangs in its reward function; rank 1 waits for it in a collective. torchrun
    forwards SIGTERM to both; both exit after the grace period, none is left waiting."""
    out = tmp_path / "run"
    args = rl_args(tiny_model_dir, out, "--runtime.preempt-grace-s", "2")
    proc, _, stderr, elapsed = signalled_run(args, out, [0.0], nproc=2)
    assert proc.returncode != 0
    assert elapsed < 2 + 10, elapsed
    assert stderr.count("did not end within runtime.preempt_grace_s = 2 s") == 2, stderr[-4000:]
    assert children(proc.pid) == []
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert resolve_resume_step("latest", out / "checkpoints") == 2
