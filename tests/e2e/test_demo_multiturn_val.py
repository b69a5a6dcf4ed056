"""The multi-turn demo's held-out numbers are read from its RL runs' in-run validation
(examples/reverse_text/demo_multiturn.py): the start state's val/start/* of the first row and
the last validated row's val/*, under the keys its JSON line has always had."""

from __future__ import annotations

import json

from examples.reverse_text.demo_multiturn import (
    feedback_validation,
    tool_validation,
    validate_start_and_end,
)


def write_run(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def val_row(prefix, reward, first, turns, tool_calls, avg, passed):
    keys = {"reward/mean": reward, "reward/first/mean": first, "turns/mean": turns}
    keys |= {"tool_calls/mean": tool_calls, "reward/avg@4": avg, "reward/pass@4": passed}
    return {prefix + key: value for key, value in keys.items()}


def test_the_demo_reads_the_start_and_the_last_validation(tmp_path):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"prompt": "a"}\n{"prompt": "b"}\n\n{"prompt": "c"}\n')
    rows = [
        {"step": 1, "reward/mean": 0.1, **val_row("val/start/", 0.5, 0.6, 1.8, 0.0, 0.4, 0.25)},
        {"step": 2, "reward/mean": 0.2},
        {"step": 3, **val_row("val/", 0.7, 0.8, 1.5, 1.0, 0.65, 0.5)},
        {"step": 4, "reward/mean": 0.3},  # a row after the last validation
    ]
    write_run(tmp_path / "rl", rows)
    result = feedback_validation(tmp_path / "rl", heldout)
    assert set(result) == {"sft", "rl", "rl_val"}
    assert result["sft"] == {
        "model": f"{tmp_path / 'rl'} at its start (step 0)",
        "single_turn": 0.6,
        "multi_turn": 0.5,
        "turns": 1.8,
        "n": 3,
    }
    assert result["rl"]["model"].endswith("rl after step 3")
    assert (result["rl"]["single_turn"], result["rl"]["multi_turn"]) == (0.8, 0.7)
    assert result["rl_val"]["start"] == {
        "single_turn": 0.6,
        "multi_turn": 0.5,
        "avg@4": 0.4,
        "pass@4": 0.25,
    }
    assert result["rl_val"]["end"]["step"] == 3 and result["rl_val"]["end"]["pass@4"] == 0.5

    tool = tool_validation(tmp_path / "rl", heldout)
    assert tool["tool_sft"] == {
        "model": f"{tmp_path / 'rl'} at its start (step 0)",
        "reward": 0.5,
        "tool_calls": 0.0,
        "turns": 1.8,
        "n": 3,
    }
    assert (tool["tool_rl"]["reward"], tool["tool_rl"]["tool_calls"]) == (0.7, 1.0)


def test_the_rl_runs_validate_their_start_and_their_end(tmp_path):
    args = validate_start_and_end(tmp_path / "h.jsonl", 40)
    assert args == ["--val.prompts", str(tmp_path / "h.jsonl"), "--val.eval-on-start"] + [
        "--val.interval",
        "40",
    ]
    assert validate_start_and_end(tmp_path / "h.jsonl", 100, 4)[-2:] == ["--val.samples", "4"]
