"""`fnt show-rollouts`: a step's trajectories as the in-process engine samples them, the sampled
tokens told apart from the context (prompt, the environment's feedback, template text), and a
step a run saved (--run), which shows the same trajectories from the file."""

from __future__ import annotations

import json
import re

import pytest

from fnt.apps.show_rollouts import saved_header, saved_pieces, trajectory_header
from fnt.errors import DataError
from fnt.rollout.environments.feedback import DEFAULT_HINT
from fnt.rollout.pack import RolloutSample
from fnt.store.samples import read_step_samples, samples_path
from tests.e2e.helpers import config_args, read_metrics, run_cli

HEADER = re.compile(
    r"^== prompt line (\d+): reward (\S+), advantage \S+, (\d+) turns?, .*; (\d+) tokens "
    r"\((\d+) sampled, (\d+) context\)$"
)


def test_show_rollouts_prints_a_steps_episodes_with_sampled_tokens_marked(policy_dir, tmp_path):
    extra = (
        "--rollout.environment",
        "tests.fnt.rollout.multi_turn_env:feedback",
        "--rollout.max-turns",
        "3",
        "--batch-size",
        "8",  # a row per episode: episodes are up to seq_len long
        "--runtime.num-threads",
        "1",
    )
    args = config_args("examples/debug/rl.toml", policy_dir, tmp_path / "run", *extra)
    shown = run_cli("show-rollouts", *args, "--step", "1", "--n", "8", "--color", "never").stdout
    headers = [HEADER.match(line) for line in shown.splitlines() if line.startswith("== ")]
    assert len(headers) == 8 and all(headers), shown
    # The texts: context as it is, sampled tokens between [[ and ]]; the hint is context.
    texts = re.split(r"^== .*$\n", shown, flags=re.M)[1:]
    multi = [t for h, t in zip(headers, texts) if int(h.group(3)) > 1]
    assert multi, shown
    for text in multi:
        context = re.sub(r"\[\[.*?\]\]", "", text, flags=re.S)
        assert DEFAULT_HINT in context
        assert DEFAULT_HINT not in "".join(re.findall(r"\[\[(.*?)\]\]", text, flags=re.S))
    for header in headers:
        total, sampled, context = (int(header.group(i)) for i in (4, 5, 6))
        assert sampled >= 1 and total == sampled + context

    # Exactly what step 1 of a run from this model samples: its row's episodes, turns, tokens.
    run_cli("rl", *args, "--max-steps", "1")
    (row,) = read_metrics(tmp_path / "run")
    assert row["rollout/episodes"] == len(headers)
    assert row["rollout/turns/mean"] == sum(int(h.group(3)) for h in headers) / len(headers)
    assert row["rollout/sampled_tokens"] == sum(int(h.group(5)) for h in headers)
    assert row["rollout/context_tokens"] == sum(int(h.group(6)) for h in headers)
    rewards = [float(h.group(2)) for h in headers]  # printed to 3 significant digits
    assert abs(sum(rewards) / len(rewards) - row["reward/mean"]) < 5e-3

    # The run saved step 1 (its last): --run shows the same trajectories from the file, the
    # trained spans marked exactly where sampling marked the sampled tokens.
    saved = run_cli("show-rollouts", "--run", str(tmp_path / "run"), "--n", "8", "--color", "never")
    lines = saved.stdout.splitlines()
    assert lines[0].startswith("step 1: 8 trajectories saved in "), lines[0]
    assert re.split(r"^== .*$\n", saved.stdout, flags=re.M)[1:] == texts
    saved_headers = [line for line in lines if line.startswith("== ")]
    for live, header in zip(headers, saved_headers):
        facts = live.group(0).split(": ", 1)[1]  # the same reward, turns, limits and counts,
        assert header.split(": ", 1)[1] == re.sub(r"\d+ tool calls \(\d+ failed\), ", "", facts)
    records = read_step_samples(tmp_path / "run", 1)
    assert (
        sum(end - start for r in records for start, end in r["trained"])
        == (row["rollout/sampled_tokens"])
    )
    assert sum(r["out_of_turns"] for r in records) == row["rollout/max_turns_episodes"]
    # --run takes no config options, and names the steps it has when asked for another.
    wrong = run_cli("show-rollouts", "--run", str(tmp_path / "run"), "--seed", "3", check=False)
    assert wrong.returncode == 2 and "--seed 3 would not apply" in wrong.stderr, wrong.stderr
    missing = run_cli("show-rollouts", "--run", str(tmp_path / "run"), "--step", "2", check=False)
    assert missing.returncode == 2 and "the steps saved are: 1" in missing.stderr, missing.stderr
    assert str(samples_path(tmp_path / "run", 2)) in missing.stderr


def test_a_trajectory_header_names_its_episode_facts():
    sample = RolloutSample(
        token_ids=(1, 2, 3, 4, 5),
        sampled=(False, True, False, True, True),
        logprobs=(0.0, -0.5, 0.0, -0.1, -0.2),
        reward=0.5,
        advantage=-1.25,
        turns=2,
        tool_calls=3,
        tool_errors=1,
        truncated=True,
        named_rewards=(("final", 0.5), ("first", 0.0)),
    )
    assert trajectory_header("prompt line 4", sample) == (
        "== prompt line 4: reward 0.5, advantage -1.25, 2 turns, 3 tool calls (1 failed), "
        "truncated, rewards: final 0.5, first 0; 5 tokens (3 sampled, 2 context)"
    )


class Letters:
    """A tokenizer of one letter per id (a = 0)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def saved_line(**changes):
    record = {
        "step": 3,
        "index": 5,
        "rank": 1,
        "prompt": "ab",
        "completion": "cde",
        "reward": None,
        "advantage": -0.5,
        "completion_tokens": 2,
        "turns": 2,
        "truncated": False,
        "out_of_turns": True,
        "policy_step": 2,
        "rewards": {"final": 0.25},
        "trained": [[2, 3], [4, 5]],
        "token_ids": [0, 1, 2, 3, 4],
    }
    return json.loads(json.dumps({**record, **changes}))


def test_a_saved_line_shows_its_facts_and_its_trained_spans():
    assert saved_header(saved_line()) == (
        "== sample 5 (rank 1): reward nan, advantage -0.5, 2 turns, out of turns, "
        "rewards: final 0.25; 5 tokens (2 sampled, 3 context)"
    )
    assert saved_pieces(saved_line(), Letters(), "f") == [
        ("ab", False),
        ("c", True),
        ("d", False),
        ("e", True),
    ]
    # A file saved before lines had token_ids: its text, unmarked.
    old = saved_line(token_ids=None, trained=None)
    assert saved_pieces(old, None, "f") == [("abcde", False)]
    assert saved_header(old).endswith("; 2 sampled tokens")
    for bad in ([[3, 2]], [[0, 6]], [[2, 4], [3, 5]], [], None, [[1.0, 2]]):
        with pytest.raises(DataError, match="f, line 2: 'trained' must be"):
            saved_pieces(saved_line(trained=bad), Letters(), "f, line 2")
