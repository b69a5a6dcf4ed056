"""A reward that records each call (tests/fnt/rollout/test_async.py counts the rollouts a run
generates): `--rollout.reward tests.fnt.rollout.counting_reward:reward`."""

from __future__ import annotations

from fnt.rollout.rewards import ascii_letters

calls: list[str] = []


def reward(completion: str, sample: dict) -> float:
    calls.append(completion)
    return ascii_letters(completion, sample)
