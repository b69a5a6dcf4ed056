"""README.md's tool-using RL example (its `my_env.py` and its `fnt rl` command) runs as printed,
in a directory laid out as a fresh clone is (the examples, the tiny model the README creates
first), for 3 steps."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .helpers import REPO, read_metrics

ENV_BLOCK = re.compile(r"```python\n(# my_env\.py\n.*?)```", re.S)
COMMAND_BLOCK = re.compile(r"```bash\n([^`]*my_env:calculator[^`]*)```")


def readme_tool_example() -> tuple[str, str]:
    """The README's my_env.py and its `fnt rl` command line (continuations joined)."""
    readme = (REPO / "README.md").read_text()
    env, command = ENV_BLOCK.search(readme), COMMAND_BLOCK.search(readme)
    assert env and command, "README.md lost its tool-RL example (my_env.py and its command)"
    return env.group(1), command.group(1).replace("\\\n", " ").strip()


def test_the_readme_tool_rl_example_trains_3_steps(tiny_model_dir, tmp_path):
    code, command = readme_tool_example()
    assert command.startswith("PYTHONPATH=. fnt rl ") and "\n" not in command
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny-model").symlink_to(tiny_model_dir)  # fnt make-tiny-model's
    (tmp_path / "my_env.py").write_text(code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        ["bash", "-c", f"{command} --max-steps 3 --output-dir {shlex.quote('runs/tools')}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(tmp_path / "runs" / "tools")
    assert [row["step"] for row in rows] == [1, 2, 3]
    # Tool episodes of up to 4 turns: more tokens than the config's rows (batch_size 4 of
    # seq_len 128) hold, which the step's packing takes in more micro-batches.
    assert all(row["rollout/episodes"] == 8 for row in rows)
    step_tokens = [row["rollout/sampled_tokens"] + row["rollout/context_tokens"] for row in rows]
    assert max(step_tokens) > 4 * 128
    assert (tmp_path / "runs" / "tools" / "checkpoints" / "step_3").is_dir()
