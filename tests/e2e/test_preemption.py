"""Preemption: SIGTERM or SIGUSR1 checkpoints the step the run is at, exits with
runtime.preempt_exit_code, and `--resume latest` then continues exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnt.resume import resolve_resume_step
from fnt.store.rundir import COMPONENTS_DIR, METRICS_FILE
from tests.e2e.helpers import (
    REPO,
    TORCHRUN,
    assert_resumed_run_matches,
    config_args,
    read_metrics,
    run_cli,
    run_fnt,
)

pytestmark = pytest.mark.numerics

# Many more steps than the signal needs to land: the run must still be training when it does.
N, K = 40, 2
EXACT_KEYS = ("loss/mean", "optim/grad_norm", "optim/lr", "progress/num_tokens")


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wait_for_rows(path: Path, rows: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run exited {proc.returncode} before row {rows}"
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {rows} rows in {timeout} s")


def preempted_run(script: str, args, out: Path, sig: int, nproc: int = 0):
    """Run scripts/`script` with args, send it `sig` once row K is written; (the finished
    process, its stdout, its stderr). Under torchrun only one worker is signalled: the ranks
    must agree to stop together (torchrun itself, when signalled, forwards SIGTERM to all its
    workers)."""
    launcher = [*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    with subprocess.Popen(
        [*launcher, str(REPO / "scripts" / script), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            wait_for_rows(out / METRICS_FILE, K, proc)
            os.kill(max(children(proc.pid)) if nproc else proc.pid, sig)
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc, stdout, stderr


@pytest.mark.parametrize(
    ("nproc", "sig", "code"),
    [
        # Slow: the default suite preempts an RL run at one rank (below), through the same driver.
        pytest.param(0, signal.SIGTERM, 143, id="1rank", marks=pytest.mark.slow),
        pytest.param(0, signal.SIGUSR1, 99, id="1rank-SIGUSR1-code99", marks=pytest.mark.slow),
        pytest.param(2, signal.SIGTERM, 143, id="2ranks", marks=pytest.mark.slow),
    ],
)
def test_a_preemption_signal_checkpoints_the_step_and_resume_continues_exactly(
    tiny_model_dir, tmp_path, nproc, sig, code
):
    def sft(*extra):
        run_fnt("sft", *args(tiny_model_dir, *extra), nproc=nproc)

    full = tmp_path / "full"
    sft(full)

    out = tmp_path / "preempted"
    proc, stdout, stderr = preempted_run(
        "sft.py",
        args(tiny_model_dir, out, "--runtime.preempt-exit-code", str(code)),
        out,
        sig,
        nproc,
    )

    if nproc:
        # torchrun fails itself and reports its workers' exit status. Once the first worker has
        # exited, torchrun SIGTERMs the others, which may still be shutting down by then (their
        # checkpoint is committed: the save ends with a barrier).
        assert proc.returncode != 0
        statuses = [int(s) for s in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]
        assert code in statuses and set(statuses) <= {code, -signal.SIGTERM}, stderr[-4000:]
    else:
        assert proc.returncode == code, stderr[-4000:]
        assert "Traceback" not in stderr, stderr[-4000:]
    stopped = [r["step"] for r in read_metrics(out)]
    last = stopped[-1]
    assert stopped == list(range(1, last + 1)) and K <= last < N, stopped
    assert resolve_resume_step("latest", out / "checkpoints") == last
    assert f"stopped after checkpointing step {last}, exit status {code}" in stdout

    sft(out, "--resume", "latest")
    assert_resumed_run_matches(full, out, last, N, EXACT_KEYS, tmp_path)


def test_a_preempted_async_rl_run_keeps_its_rollout_policies_in_the_checkpoint_and_resumes_exactly(
    tiny_model_dir, tmp_path
):
    """rollout.async_level = 2: the policies the next rollouts come from are the engine's state,
    saved inside the preemption's checkpoint; nothing is written beside the checkpoints."""
    steps = 12

    def rl_args(out, *extra):
        return config_args(
            "examples/debug/rl.toml",
            tiny_model_dir,
            out,
            *("--max-steps", str(steps), "--rollout.async-level", "2"),
            *("--runtime.num-threads", "1", *extra),
        )

    full, out = tmp_path / "full", tmp_path / "preempted"
    run_cli("rl", *rl_args(full))
    proc, stdout, stderr = preempted_run("rl.py", rl_args(out), out, signal.SIGTERM)
    assert proc.returncode == 143, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    rows = [r["step"] for r in read_metrics(out)]
    last = rows[-1]
    assert rows == list(range(1, last + 1)) and K <= last < steps, rows
    assert resolve_resume_step("latest", out / "checkpoints") == last
    assert f"stopped after checkpointing step {last}, exit status 143" in stdout
    assert (out / "checkpoints" / f"step_{last}" / COMPONENTS_DIR / "rollouts.pt").is_file()
    # Nothing half-written beside the checkpoints: the saved samples (a step's file is written
    # whole) of the steps that ran, and no other directory.
    assert {p.name for p in out.iterdir() if p.is_dir()} <= {"checkpoints", "samples"}
    saved = (
        sorted(p.name for p in (out / "samples").glob("*")) if (out / "samples").is_dir() else []
    )
    assert all(re.fullmatch(r"step_\d+\.jsonl", n) and int(n[5:-6]) <= last for n in saved), saved
    run_cli("rl", *rl_args(out, "--resume", "latest"))
    keys = ("loss/mean", "reward/mean", "optim/grad_norm", "rollout/staleness")
    assert_resumed_run_matches(full, out, last, steps, keys, tmp_path)
