"""An RL run's saved samples through a kill and a resume: each step's samples/step_N.jsonl once,
the same as an uninterrupted run's, and the W&B run holding one samples table per step with the
file's rows (the W&B stub keeps its history as the server would, fnt.testing.WANDB_STUB)."""

from __future__ import annotations

import json

import pytest

from fnt.obs.monitors.wandb import SAMPLE_COLUMNS, recorded_wandb_run_id
from fnt.store.samples import read_step_samples, saved_sample_steps
from fnt.testing import WANDB_STUB
from tests.e2e.helpers import REPO, config_args, run_cli, run_fnt, run_killed


@pytest.mark.slow
def test_a_killed_and_resumed_run_saves_each_steps_samples_once_and_logs_them_to_wandb(
    tiny_model_dir, tmp_path
):
    steps = ("--max-steps", "4", "--ckpt.interval", "2", "--rollout.log-samples-every", "1")
    straight = tmp_path / "straight"
    run_cli("rl", *config_args("examples/debug/rl.toml", tiny_model_dir, straight, *steps))
    out, server = tmp_path / "run", tmp_path / "server"
    server.mkdir()
    env = {"PYTHONPATH": f"{WANDB_STUB}:{REPO}", "SLOW_WANDB_HISTORY": str(server)}
    args = config_args(
        "examples/debug/rl.toml", tiny_model_dir, out, *steps, "--wandb.mode", "offline"
    )
    # Killed after row 3 (so after step 3's samples), before a checkpoint of step 3.
    run_killed(*args, fault="row@3", env=env, script="rl.py")
    assert saved_sample_steps(out) == [1, 2, 3]
    run_fnt("rl", *args, "--resume", "latest", env=env)
    assert saved_sample_steps(out) == saved_sample_steps(straight) == [1, 2, 3, 4]
    history = json.loads((server / f"{recorded_wandb_run_id(out)}.json").read_text())
    assert sorted(map(int, history)) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        records = read_step_samples(out, step)
        assert records == read_step_samples(straight, step), step
        assert [r["index"] for r in records] == list(range(8))
        table = history[str(step)]["samples"]
        assert table["columns"] == list(SAMPLE_COLUMNS)
        assert table["data"] == [[r[key] for key in SAMPLE_COLUMNS] for r in records], step
