"""What a user sees on the console: the start-up phases from the first second, a bar while data
is tokenized (only on a terminal), the start-up summary, step lines with grad norm (and reward
in RL, val/* when evaluated), the end summary; no bar control characters off a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, TORCHRUN, config_args, run_cli

PHASES = ("reading the data", "loading the model", "building the optimizer")


def run_in_a_terminal(args: list[str], timeout: float = 180, nproc: int = 0) -> str:
    """`python -m fnt ARGS` (under torchrun with `nproc` ranks when nproc > 0) with stdout and
    stderr on a pseudo-terminal; everything it printed."""
    leader, follower = pty.openpty()
    # A terminal of 40 x 120 characters (a new pseudo-terminal is 0 x 0, where a bar is empty).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    child = subprocess.Popen(
        [*([*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]), "-m"]
        + ["fnt", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            assert ready, "the run printed nothing for too long"
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower side closed: the run is over
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        child.wait(timeout=60)
    assert child.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def sources_args(path: Path) -> tuple[str, ...]:
    return ("--data.kind", "sources", "--data.sources", json.dumps([{"path": str(path)}]))


def write_chats(path: Path, n: int = 40) -> Path:
    record = {"prompt": "count to three", "completion": "1 2 3"}
    path.write_text("".join(json.dumps(record) + "\n" for _ in range(n)))
    return path


def lines_of(text: str) -> list[str]:
    return [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]


def assert_start_and_end(lines: list[str], steps: int) -> None:
    """The phases in order, each `[  1.2 s] ...`, before the first step; the summaries."""
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    found = [
        next(i for i, line in enumerate(lines) if line.startswith("[") and phase in line)
        for phase in PHASES
    ]
    assert found == sorted(found) and found[-1] < first_step, lines
    assert any("parameters: " in line and "trainable)" in line for line in lines), lines
    assert any(f"steps: {steps} (to step {steps})" in line for line in lines), lines
    assert lines[-1].startswith(f"done: steps 1..{steps} in "), lines[-3:]
    assert f"checkpoint step_{steps}" in lines[-1]


def test_an_sft_run_on_a_terminal_shows_phases_a_bar_summaries_and_grad_norm(
    tiny_model_dir, tmp_path
):
    data = write_chats(tmp_path / "train.jsonl")
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    extra = ("--max-steps", "2", "--val.sources", json.dumps([{"path": str(data)}]))
    val = ("--val.interval", "1", "--val.eval-on-start")
    text = run_in_a_terminal(["sft", *args, *sources_args(data), *extra, *val])
    lines = lines_of(text)
    assert "\r" in text and "records/s" in text  # tqdm's bar, redrawn in place
    assert any("data train: 40 samples" in line for line in lines), lines
    assert any(
        line.endswith("] ranks: 1 on cpu (data-parallel 1: 1 replica x 1 shard)") for line in lines
    ), lines
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(" | grad " in s and " | val/loss " in s for s in steps), steps
    # val.eval_on_start: the start state's loss, in the first step's line only.
    assert " | val/start/loss " in steps[0] and "val/start" not in steps[1], steps
    assert_start_and_end(lines, 2)


@pytest.mark.slow
def test_a_torchrun_run_on_a_terminal_says_how_many_ranks_train(tiny_model_dir, tmp_path):
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    lines = lines_of(run_in_a_terminal(["sft", *args, "--max-steps", "2"], nproc=2))
    ranks = [line for line in lines if "] ranks: " in line]
    assert len(ranks) == 1 and ranks[0].endswith(
        "ranks: 2 on cpu (data-parallel 2: 1 replica x 2 shards)"
    ), lines
    assert_start_and_end(lines, 2)


def test_an_rl_run_on_a_terminal_shows_its_setup_rollouts_samples_and_validation_reward(
    tiny_model_dir, tmp_path
):
    """The RL start-up summary (engine, prompts x group, reward, async_level, max_new_tokens,
    model), step lines with rollout time, completion length and cut fraction, and after the
    sample step (2 of 3) a few of its completions, all of which are in samples/step_2.jsonl."""
    out = tmp_path / "run"
    args = config_args("examples/debug/rl.toml", tiny_model_dir, out)
    val = ("--val.prompts", "examples/debug/prompts.jsonl", "--val.interval", "2")
    samples = ("--rollout.log-samples-every", "2")
    lines = lines_of(run_in_a_terminal(["rl", *args, "--max-steps", "3", *val, *samples]))
    summary = "\n".join(line for line in lines if line.startswith("["))
    assert f" trainable), model {tiny_model_dir}\n" in summary, summary
    assert "engine in_process, 2 prompts x 4 completions = 8 samples per step" in summary
    assert "max_new_tokens 12" in summary and "reward ascii_letters" in summary
    assert "async_level 0 (on-policy)" in summary and "tokens per step" not in summary
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all(" | reward " in s and " | grad " in s for s in steps), steps
    assert all(" | len " in s and " | cut " in s and " s | " in s for s in steps), steps
    assert all(" | rollout " in s for s in steps), steps
    assert " | val/reward " in steps[1] and " | val/reward " not in steps[0]
    heads = [i for i, line in enumerate(lines) if line.startswith("samples of step ")]
    step_2, step_3 = lines.index(steps[1]), lines.index(steps[2])
    assert [lines[i] for i in heads] == [
        f"samples of step 2: 3 of 8 (all in {out / 'samples' / 'step_2.jsonl'})",
        f"samples of step 3: 3 of 8 (all in {out / 'samples' / 'step_3.jsonl'})",
    ]
    assert heads[0] == step_2 + 1 and heads[1] == step_3 + 1, lines
    shown = lines[step_2 + 2 : step_2 + 5]
    assert all(line.startswith("reward ") and " -> " in line for line in shown), shown
    saved = [json.loads(line) for line in (out / "samples" / "step_2.jsonl").open()]
    assert [r["index"] for r in saved] == list(range(8)), saved
    for line in shown:
        assert any(line.startswith(f"reward {r['reward']:.3f} | ") for r in saved), line
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_2.jsonl", "step_3.jsonl"]
    assert_start_and_end(lines, 3)


def test_off_a_terminal_the_console_has_plain_lines_only(tiny_model_dir, tmp_path):
    data = write_chats(tmp_path / "train.jsonl")
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    proc = run_cli("sft", *args, *sources_args(data), "--max-steps", "2")
    assert "\r" not in proc.stdout and "\x1b[" not in proc.stdout
    lines = lines_of(proc.stdout)
    assert any("tokenizing " in line and "40 records in" in line for line in lines), lines
    assert_start_and_end(lines, 2)
