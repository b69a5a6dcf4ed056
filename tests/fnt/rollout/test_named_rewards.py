"""Named rewards summed in one place (fnt.rollout.base: a rank's samples, all ranks' sums and
validation's greedy answers go through the same functions), and the reward name that the
episode rules carry for rollout.on_bad_reward's message (fnt.rollout.environments.episodes)."""

from __future__ import annotations

import math

import pytest

from fnt.rollout.base import merge_named_sums, named_reward_means, named_sums
from fnt.rollout.environments.episodes import Episode, EpisodeRules, scored_samples
from fnt.rollout.prompts import Prompt


def test_named_sums_count_each_value_once_and_a_merge_adds_counts_and_sums():
    rank0 = named_sums([("final", 1.0), ("first", 0.5), ("final", 0.0)])
    assert rank0 == {"final": [2.0, 1.0], "first": [1.0, 0.5]}
    rank1 = named_sums([("tool", 1.0), ("final", 1.0)])
    merged = merge_named_sums([rank0, rank1])
    assert merged == {"final": [3.0, 2.0], "first": [1.0, 0.5], "tool": [1.0, 1.0]}
    assert list(merged) == ["final", "first", "tool"]  # in the order they first appear
    assert named_reward_means(merged) == {
        "reward/final/mean": 2.0 / 3.0,
        "reward/first/mean": 0.5,
        "reward/tool/mean": 1.0,
    }
    assert merge_named_sums([]) == {} and named_reward_means({}) == {}


class NanScore:
    """An environment whose every episode scores NaN."""

    def score(self, record, messages) -> float:
        return math.nan


def one_group(line: int) -> list[list[Episode]]:
    prompt = Prompt({"prompt": "p"}, (1, 2), line)
    return [
        [
            Episode(prompt, 0, i, [1, 2, 3], [False, False, True], [0.0, 0.0, -0.5], [], turns=1)
            for i in range(2)
        ]
    ]


def rules(on_bad_reward: str) -> EpisodeRules:
    return EpisodeRules(
        group_size=2,
        max_new_tokens=4,
        max_turns=1,
        max_episode_tokens=64,
        on_truncated="score",
        on_bad_reward=on_bad_reward,
        std_normalize=True,
        prompts_path="p.jsonl",
        name="environment 'pkg.env:make'",
        reward_name="pkg.env:make",
    )


def test_a_bad_reward_is_named_by_the_reward_name_the_rules_carry():
    with pytest.raises(ValueError, match=r"^reward 'pkg\.env:make' returned nan on .* line 3 "):
        scored_samples(one_group(3), NanScore(), rules("error"))
    samples, dropped = scored_samples(one_group(3), NanScore(), rules("skip"))
    assert dropped == 0 and [s.advantage for s in samples] == [0.0, 0.0]
