"""The user's own rewards and environments on `fnt rl`'s command line: called once on the first
prompt before any model is built, so a raise or a wrong return is one `error:` line (the
function, what it raised or returned, the prompt), then the user's own frames and no frame of
fnt's, exit status 2 and no run directory; during training a raising reward stops the run the
same way, or under rollout.on_bad_reward = "skip" is skipped and counted (fnt.rollout.user_code).
"""

from __future__ import annotations

import re
import sys

import pytest

from .helpers import REPO, config_args, read_metrics, run_cli

USER_MODULE = """
from fnt.rollout.environments import ToolEnvironment
from fnt.rollout.rewards import exact_match


def as_text(completion, sample):
    return "1.0"


def divide(completion, sample):
    return len(completion) / (len(sample["answer"]) - len(sample["answer"]))


def odd_raises(completion, sample):
    if len(completion) % 2:
        raise KeyError("odd length")
    return float(len(completion) % 5)


def odd_as_text(completion, sample):
    return "high" if len(completion) % 2 else float(len(completion) % 5)


def broken_factory(rollout):
    return helper(rollout)


def helper(rollout):
    raise RuntimeError("no tools today")


class BadStart(ToolEnvironment):
    def start(self, record):
        return record["missing_key"]


def bad_start(rollout):
    return BadStart([], exact_match)


class BadScore(ToolEnvironment):
    def score(self, record, messages):
        return None


def bad_score(rollout):
    return BadScore([], exact_match)
"""
NAME = "fnt_user_code_probe"
PROMPTS = str(REPO / "examples" / "debug" / "prompts.jsonl")


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    where = tmp_path_factory.mktemp("user_code")
    (where / f"{NAME}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(where))
    yield where / f"{NAME}.py"
    sys.path.remove(str(where))
    sys.modules.pop(NAME, None)


def rl(model_dir, out, *extra: str):
    args = config_args("examples/debug/rl.toml", model_dir, out, "--rollout.prompts", PROMPTS)
    return run_cli("rl", *args, "--max-steps", "2", *extra, check=False)


@pytest.mark.parametrize(
    "key, function, error",
    [
        ("reward", "as_text", r"reward '.*:as_text' returned '1\.0' on the prompt of line 1 of "),
        (
            "reward",
            "divide",
            r"reward '.*:divide' failed on the prompt of line 1 of .*prompts\.jsonl with the "
            r"trial completion '15 16 17', at start-up: ZeroDivisionError: division by zero",
        ),
        (
            "environment",
            "broken_factory",
            r"environment factory '.*:broken_factory' \(rollout\.environment\) failed: "
            r"RuntimeError: no tools today",
        ),
        (
            "environment",
            "bad_start",
            r"environment '.*:bad_start' failed to start the prompt of line 1 of .*: "
            r"KeyError: 'missing_key'",
        ),
        ("environment", "bad_score", r"environment '.*:bad_score' returned None on the prompt"),
    ],
)
def test_users_code_failing_at_start_up_is_one_line_and_its_own_frames(
    tiny_model_dir, tmp_path, user_module, key, function, error
):
    out = tmp_path / "run"
    result = rl(tiny_model_dir, out, f"--rollout.{key}", f"{NAME}:{function}")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[0] == errors[0], result.stderr
    assert re.search(error, errors[0]), errors[0]
    # Whatever follows is the user's frames ("File ..." and its source line), never fnt's.
    frames = [line for line in lines[1:] if line.lstrip().startswith("File ")]
    assert all(str(user_module) in line for line in frames), lines
    assert len(lines) - 1 <= 3 * len(frames)  # each frame: its File line, code and carets
    assert "Traceback" not in result.stderr and "/fnt/" not in result.stderr
    assert not out.exists()  # told before the run directory was made
    if function in ("divide", "broken_factory", "bad_start"):
        assert frames  # a raise shows where, in the user's file


def test_a_reward_raising_in_training_stops_the_run_or_is_skipped_and_counted(
    tiny_model_dir, tmp_path, user_module
):
    # The trial completion ('15 16 17', the first record's answer) has an even length, so the
    # reward passes at start-up and raises on the first odd-length completion it is given.
    reward = ("--rollout.reward", f"{NAME}:odd_raises")
    stopped = rl(tiny_model_dir, tmp_path / "stopped", *reward)
    assert stopped.returncode == 2
    lines = stopped.stderr.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    assert "Traceback" not in stopped.stderr and "/fnt/" not in stopped.stderr
    assert lines[first].startswith(
        f"error: reward '{NAME}:odd_raises' failed on the prompt of line"
    )
    assert "(episode " in lines[first] and lines[first].endswith("KeyError: 'odd length'")
    assert all(str(user_module) in line for line in lines[first + 1 :] if "File " in line)

    skipped = tmp_path / "skipped"
    result = rl(tiny_model_dir, skipped, *reward, "--rollout.on-bad-reward", "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(skipped)
    assert [row["step"] for row in rows] == [1, 2]
    assert sum(row["rollout/bad_rewards"] for row in rows) > 0


@pytest.mark.parametrize("on_bad_reward", ["error", "skip"])
def test_a_reward_returning_no_number_in_training_stops_the_run_either_way(
    tiny_model_dir, tmp_path, user_module, on_bad_reward
):
    # A wrong type is a bug, not a hard sample: "skip" does not hide it.
    reward = ("--rollout.reward", f"{NAME}:odd_as_text", "--rollout.on-bad-reward", on_bad_reward)
    result = rl(tiny_model_dir, tmp_path / "run", *reward)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.match(
        rf"error: reward '{NAME}:odd_as_text' returned 'high' on the prompt of line \d+ of "
        r".*; expected a float",
        errors[0],
    ), errors[0]
