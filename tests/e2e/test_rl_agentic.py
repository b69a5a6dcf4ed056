"""examples/debug/rl_agentic.toml (README.md's "RL, one setting per need") trains as printed, in
a directory laid out as a fresh clone is: two environments mixed, each in worker processes, with
per-turn credit, difficulty filtering, truncated importance weights and whole held-out episodes.
Slow: tests/fnt/test_readme_rl.py checks the same config's validity and start-up in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO, read_metrics


@pytest.mark.slow
def test_the_agentic_rl_example_trains_2_steps(tiny_model_dir, tmp_path):
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-model").symlink_to(tiny_model_dir)  # fnt make-tiny-model's
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = "."
    command = "fnt rl --config examples/debug/rl_agentic.toml --max-steps 2 --output-dir runs/a"
    out = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(tmp_path / "runs" / "a")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/env_failures"] == 0.0
        assert row["rollout/hint/episodes"] + row["rollout/three/episodes"] == 8
        assert row["rollout/filter_rounds"] >= 1 and "loss/is_clipped_fraction" in row
    assert {"val/reward/avg@4", "val/hint/reward/pass@4"} <= set(rows[1])
