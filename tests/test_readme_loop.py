"""The research loop shown in README.md runs as printed (so it cannot rot)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = re.compile(
    r"<!-- research-loop:start -->\n```python\n(.*?)```\n<!-- research-loop:end -->", re.S
)


def readme_loop() -> str:
    match = LOOP.search((REPO / "README.md").read_text())
    assert match, "README.md lost its research-loop block"
    return match.group(1)


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
