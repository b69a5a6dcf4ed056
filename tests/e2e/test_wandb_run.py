"""Real runs with a stub W&B: one that hangs, where training goes on at its own pace and W&B is
dropped with one warning (the W&B calls run on a thread of their own,
fnt.obs.monitors.wandb.WandbMonitor); and one slower than training, killed, whose resumed W&B run
holds the rows of metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from fnt.obs.monitors.wandb import recorded_wandb_run_id
from fnt.testing import WANDB_STUB
from tests.e2e.helpers import REPO, config_args, read_metrics, run_fnt, run_killed, run_script

SLOW_WANDB = WANDB_STUB


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
        env={"PYTHONPATH": f"{SLOW_WANDB}:{REPO}", "SLOW_WANDB_LOG_SECONDS": "30"},
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


@pytest.mark.parametrize(
    ("fault", "hold_after", "nproc"),
    [
        pytest.param("committed@8", 3, 0, id="behind-killed-after-step_8"),
        pytest.param("row@6", 3, 0, id="behind-killed-after-row-6", marks=pytest.mark.slow),
        pytest.param("row@6", None, 0, id="ahead-killed-after-row-6", marks=pytest.mark.slow),
        pytest.param("committed@8", 3, 2, id="2ranks-behind", marks=pytest.mark.slow),
    ],
)
def test_after_a_kill_the_wandb_run_holds_the_rows_of_metrics_jsonl(
    tiny_model_dir, tmp_path, fault, hold_after, nproc
):
    """A W&B behind training (it takes 3 rows, then hangs) or keeping up, a SIGKILL, `--resume
    latest`: the W&B run (the stub's server-side history) ends with exactly the rows of
    metrics.jsonl, 1..12."""
    out, server = tmp_path / "run", tmp_path / "server"
    server.mkdir()
    env = {
        "PYTHONPATH": f"{SLOW_WANDB}:{REPO}",
        "SLOW_WANDB_LOG_SECONDS": "0",
        "SLOW_WANDB_HISTORY": str(server),
    }
    args = config_args(
        "examples/debug/sft.toml",
        tiny_model_dir,
        out,
        *("--max-steps", "12", "--ckpt.interval", "4", "--wandb.mode", "offline"),
    )
    held = {} if hold_after is None else {"SLOW_WANDB_HOLD_AFTER": str(hold_after)}
    run_killed(*args, fault=fault, nproc=nproc, env=env | held)
    run_id = recorded_wandb_run_id(out)
    before = json.loads((server / f"{run_id}.json").read_text())
    if hold_after is not None:
        # W&B was behind when the run died: metrics.jsonl had at least 6 rows.
        assert len(before) <= hold_after < len(read_metrics(out)), before.keys()
    run_fnt("sft", *args, "--resume", "latest", nproc=nproc, env=env)
    rows = read_metrics(out)
    history = json.loads((server / f"{recorded_wandb_run_id(out)}.json").read_text())
    assert [int(s) for s in history] == [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        assert history[str(row["step"])]["loss/mean"] == row["loss/mean"], row["step"]
