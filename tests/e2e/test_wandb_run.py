"""A real run whose W&B hangs: training goes on at its own pace and W&B is dropped with one
warning (the W&B calls run on a thread of their own, fnt.monitors.WandbMonitor)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import REPO, config_args, read_metrics, run_script

SLOW_WANDB = REPO / "tests" / "e2e" / "slow_wandb"


@pytest.mark.parametrize(
    "nproc", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
def test_a_wandb_log_that_takes_30_s_does_not_slow_the_run(tiny_model_dir, tmp_path, nproc):
    # At 2 ranks a rank 0 held up by W&B would also leave rank 1 waiting in its collectives.
    out = tmp_path / "run"
    proc = run_script(
        "sft.py",
        *config_args("examples/debug/sft.toml", tiny_model_dir, out, "--max-steps", "4"),
        "--wandb.mode",
        "offline",
        "--wandb.timeout-s",
        "1",
        env={"PYTHONPATH": f"{SLOW_WANDB}:{REPO}"},
        nproc=nproc,
        # Each of the 4 logs takes 30 s: a run that waited for W&B would be killed here.
        timeout=25 if nproc == 0 else 28,
    )
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    warned = [
        line
        for line in proc.stderr.splitlines()
        if "disabling W&B" in line or "giving up on it" in line
    ]
    assert len(warned) == 1, proc.stderr[-3000:]
