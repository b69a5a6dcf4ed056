"""An RL run's console and saved samples, piece by piece: the step line's rollout fields, the RL
start-up summary, which steps save samples, their files (written whole, dropped past a resume's
start), the console's few samples and the W&B table (the runs: tests/e2e/test_console.py,
tests/e2e/test_rl_samples.py)."""

from __future__ import annotations

import json
import types

from fnt.config import RLConfig
from fnt.obs.console import rl_summary
from fnt.obs.monitors.console import console_line, sample_lines
from fnt.obs.monitors.wandb import SAMPLE_COLUMNS, samples_table
from fnt.rollout.environments.episodes import EpisodeSample
from fnt.rollout.pack import RolloutSample
from fnt.rollout.saved_samples import sample_record, trained_spans
from fnt.store.samples import (
    drop_samples_after_,
    is_sample_step,
    read_step_samples,
    samples_path,
    saved_sample_steps,
    write_step_samples_,
)


def test_an_rl_step_line_has_rollout_time_completion_length_and_cut_fraction():
    row = {
        "step": 2,
        "reward/mean": 0.5,
        "rollout/turns/mean": 1.0,
        "rollout/completion_len/mean": 11.5,
        "rollout/truncated_fraction": 1.0,
        "time/rollout": 0.25,
    }
    line = console_line(row, 4, 1.0, 1)
    assert " | len 11.5 | cut 100% | " in line and " | rollout 0.25 s | " in line, line
    assert " | cut 0% | " in console_line({**row, "rollout/truncated_fraction": 0.0}, 4, 1.0, 1)
    # Running out of turns has a column of its own, after the length cuts.
    line = console_line({**row, "rollout/max_turns_fraction": 0.5}, 4, 1.0, 1)
    assert " | cut 100% | max_turns 50% | " in line, line


def test_the_rl_summary_names_engine_prompts_group_reward_async_and_limits():
    rollout = RLConfig().rollout
    rollout = type(rollout)(
        prompts_per_step=8, group_size=4, reward="exact_match", async_level=1, max_new_tokens=64
    )
    lines = rl_summary(
        model="m",
        parameters=2_000_000,
        trainable=1_000,
        start_step=0,
        max_steps=10,
        rollout=rollout,
        prompts=40,
    )
    text = "\n".join(lines)
    assert "parameters: 2M (1k trainable), model m" in text
    assert "engine in_process, 8 prompts x 4 completions = 32 samples per step" in text
    assert "max_new_tokens 64" in text and "reward exact_match" in text
    assert "async_level 1 (step n trains on rollouts of the policy after step n-2)" in text
    assert "steps: 10 (to step 10), about 2 passes over 40 prompts" in text
    assert "tokens per step" not in text


def test_sample_steps_default_to_four_a_run_and_the_last():
    assert [s for s in range(1, 11) if is_sample_step(s, 0, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 4) if is_sample_step(s, 0, 3)] == [1, 2, 3]
    assert [s for s in range(1, 6) if is_sample_step(s, 2, 5)] == [2, 4, 5]
    assert not any(is_sample_step(s, -1, 5) for s in range(1, 6))


def test_a_samples_file_is_written_whole_and_a_resume_drops_the_steps_it_redoes(tmp_path):
    for step in (2, 4, 6):
        write_step_samples_(tmp_path, step, [{"step": step, "reward": 1.0}])
    samples_path(tmp_path, 8).with_suffix(".jsonl.tmp").write_text('{"torn"')
    assert read_step_samples(tmp_path, 4) == [{"step": 4, "reward": 1.0}]
    assert read_step_samples(tmp_path, 3) is None
    (line,) = drop_samples_after_(tmp_path, 3)
    assert "steps 4, 6" in line and "it redoes them" in line
    assert saved_sample_steps(tmp_path) == [2]
    assert list((tmp_path / "samples").iterdir()) == [samples_path(tmp_path, 2)]
    assert drop_samples_after_(tmp_path, 3) == []


class Letters:
    """A tokenizer of one letter per id (a = 0)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_a_sample_record_splits_prompt_and_completion_at_the_first_sampled_token():
    sample = RolloutSample(
        token_ids=(0, 1, 2, 3, 4),
        sampled=(False, False, True, False, True),
        logprobs=(0.0, 0.0, -1.0, 0.0, -1.0),
        reward=float("nan"),
        advantage=0.5,
        turns=2,
        truncated=True,
        named_rewards=(("format", 1.0),),
    )
    record = sample_record(sample, Letters())
    assert record["prompt"] == "ab" and record["completion"] == "cde"
    assert record["reward"] is None and record["rewards"] == {"format": 1.0}
    assert record["completion_tokens"] == 2 and record["turns"] == 2 and record["truncated"]
    assert not record["out_of_turns"]
    # What was trained: the sampled spans' [start, end) offsets in the whole token sequence.
    assert record["token_ids"] == [0, 1, 2, 3, 4] and record["trained"] == [[2, 3], [4, 5]]
    assert json.loads(json.dumps(record)) == record
    out = EpisodeSample(**{**vars(sample), "truncated": False, "out_of_turns": True})
    record = sample_record(out, Letters())
    assert record["out_of_turns"] and not record["truncated"]


def test_trained_spans_are_the_runs_of_sampled_tokens():
    assert trained_spans([False, True, True, False, True]) == [[1, 3], [4, 5]]
    assert trained_spans([False, False, True]) == [[2, 3]]
    assert trained_spans([False, True, False, False, True, True]) == [[1, 2], [4, 6]]
    assert trained_spans([False]) == []


def records(rewards):
    return [
        {
            "step": 1,
            "index": i,
            "rank": 0,
            "prompt": f"p{i}",
            "completion": f"c{i}",
            "reward": r,
            "advantage": 0.0,
            "completion_tokens": 3,
            "turns": 1,
            "truncated": i == 0,
            "policy_step": 0,
        }
        for i, r in enumerate(rewards)
    ]


def test_the_console_shows_the_best_a_middle_and_the_worst_sample():
    lines = sample_lines(5, records([0.5, None, 1.0, 0.0, 0.25]), "run/samples/step_5.jsonl")
    assert lines[0] == "samples of step 5: 3 of 5 (all in run/samples/step_5.jsonl)"
    assert [line.split(" | ")[0] for line in lines[1:]] == [
        "  reward 1.000",
        "  reward 0.250",
        "  reward nan",
    ]
    assert lines[1].endswith("'p2' -> 'c2'")
    assert sample_lines(1, records([0.5]), "f")[1:] == [
        "  reward 0.500 | 3 tokens, cut by a length limit | 'p0' -> 'c0'"
    ]
    out = [{**records([0.5])[0], "truncated": False, "out_of_turns": True}]
    assert sample_lines(1, out, "f")[1] == "  reward 0.500 | 3 tokens, out of turns | 'p0' -> 'c0'"


def test_the_wandb_table_has_a_row_per_sample_and_a_column_per_named_reward():
    fake = types.SimpleNamespace(Table=lambda columns, data: (columns, data))
    rows = records([1.0, 0.0])
    rows[1]["rewards"] = {"format": 0.5}
    columns, data = samples_table(fake, rows)
    assert columns == [*SAMPLE_COLUMNS, "reward/format"]
    assert data[0][:6] == [1, 0, 0, "p0", "c0", 1.0] and data[0][-1] is None
    assert data[1][SAMPLE_COLUMNS.index("completion")] == "c1" and data[1][-1] == 0.5
    assert "out_of_turns" in SAMPLE_COLUMNS  # a column, beside truncated, for each row
    rows[0]["out_of_turns"] = True
    _, data = samples_table(fake, rows)
    assert [row[SAMPLE_COLUMNS.index("out_of_turns")] for row in data] == [True, None]
