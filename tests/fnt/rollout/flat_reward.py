"""Rewards that are the same for every completion of some prompts (their groups carry no signal),
for the tests of rollout.filter_groups: `--rollout.reward tests.fnt.rollout.flat_reward:NAME`,
and an environment of episodes scored so (`--rollout.environment ...:feedback_every_third`)."""

from __future__ import annotations

from fnt.rollout.environments import FeedbackEnvironment
from fnt.rollout.rewards import ascii_letters


def spread(completion: str) -> float:
    """A reward that differs between almost any two completions."""
    return (sum(map(ord, completion)) % 101) / 100


def is_flat(record: dict) -> bool:
    """The prompts of tests/conftest.py's prompts file whose groups `every_third` flattens."""
    return record["id"] % 3 == 0


def every_third(completion: str, sample: dict) -> float:
    """1.0 for every completion of every third prompt (ids 0, 3, 6, ...), else `spread`."""
    return 1.0 if is_flat(sample) else spread(completion)


def everywhere(completion: str, sample: dict) -> float:
    """`spread` for every prompt: no group is flat."""
    return spread(completion)


def nowhere(completion: str, sample: dict) -> float:
    """The same reward for everything: every group is flat."""
    return 1.0


def even_counts(completion: str, sample: dict) -> float:
    """examples/debug/prompts.jsonl: 0.5 for the prompts whose last number is even, else
    ascii_letters (the debug config's reward)."""
    if int(sample["prompt"].split()[-1]) % 2 == 0:
        return 0.5
    return ascii_letters(completion, sample)


def feedback_every_third(rollout):
    """Episodes of retries after a hint (FeedbackEnvironment) scored by `every_third`: a flat
    prompt's episodes end after one turn, the others' mostly go on."""
    return FeedbackEnvironment(every_third, threshold=0.95)
