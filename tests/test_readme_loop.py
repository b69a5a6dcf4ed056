"""The research loop shown in README.md, the test of your own step in docs/testing.md and the
preference loss of your own in docs/dpo.md run as printed (so they cannot rot)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOOP = re.compile(
    r"<!-- research-loop:start -->\n```python\n(.*?)```\n<!-- research-loop:end -->", re.S
)


TESTING_EXAMPLE = re.compile(
    r"<!-- testing-example:start -->\n```python\n(.*?)```\n<!-- testing-example:end -->", re.S
)


def readme_block(pattern: re.Pattern, page: str = "README.md") -> str:
    match = pattern.search((REPO / page).read_text())
    assert match, f"{page} lost its block {pattern.pattern[:30]}"
    return match.group(1)


def readme_loop() -> str:
    return readme_block(LOOP)


def test_the_readme_research_loop_is_short_public_and_trains(tiny_model_dir, tmp_path):
    code = readme_loop()
    assert len(code.strip().splitlines()) <= 15
    for module in re.findall(r"^(?:from|import) (\S+)", code, re.M):
        assert module in ("fnt", "steps"), f"the loop imports {module}, not only fnt and steps"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-model").symlink_to(tiny_model_dir)
    with open(tmp_path / "train.jsonl", "w") as fh:
        for i in range(16):
            fh.write(
                json.dumps({"prompt": f"count to {i % 5}", "completion": "1 2 3 4"[: 1 + i % 7]})
            )
            fh.write("\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    *rows, restored = [line.split() for line in out.stdout.splitlines()]
    assert [int(step) for step, _ in rows] == list(range(1, 11))
    losses = [float(loss) for _, loss in rows]
    assert losses[-1] < losses[0], losses
    assert restored == ["restored", "10"]
    assert (tmp_path / "runs" / "default" / "checkpoints" / "step_10" / "COMPLETE").is_file()


@pytest.mark.slow
def test_the_readme_test_of_your_own_step_passes(tiny_model_dir, tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-model").symlink_to(tiny_model_dir)
    (tmp_path / "test_my_step.py").write_text(readme_block(TESTING_EXAMPLE, "docs/testing.md"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_step.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-4000:]


DPO_LOOP = re.compile(r"<!-- dpo-loop:start -->\n```python\n(.*?)```\n<!-- dpo-loop:end -->", re.S)


def test_the_readme_preference_loss_of_your_own_runs_and_learns(tiny_model_dir, tmp_path):
    match = DPO_LOOP.search((REPO / "docs" / "dpo.md").read_text())
    assert match, "docs/dpo.md lost its dpo-loop block"
    code = match.group(1)
    assert len(code.strip().splitlines()) <= 16
    for module in re.findall(r"^(?:from|import) (\S+)", code, re.M):
        assert module in ("fnt", "steps", "torch"), f"the loop imports {module}"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-model").symlink_to(tiny_model_dir)
    (tmp_path / "pairs.jsonl").write_text((REPO / "examples/debug/pairs.jsonl").read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert [int(step) for step, _ in rows] == list(range(1, 11))
    losses = [float(loss) for _, loss in rows]
    assert losses[0] == 1.0  # the policy is its reference: every margin is 0
    assert losses[-1] < losses[0], losses
