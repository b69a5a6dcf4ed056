"""Reward functions for RL rollouts, looked up by name, and what to do with a bad reward. Pure,
except that resolving a "module:function" name imports that module.

A reward function is `fn(completion: str, sample: dict) -> float`: `completion` is the generated
text decoded without special tokens (so without the closing eos), `sample` is the prompt's JSONL
record with all its fields (e.g. "answer"). `reward_function(name)` resolves either a name in
REWARDS or a "module:function" string naming any importable function of that shape
(`fnt.config.references.import_function`, which `loss.custom` uses too). `require_reward` is the
up-front check of `rollout.reward`: a ConfigError naming the key, before any model is built.

A reward that is NaN or infinite is bad. `rollout.on_bad_reward` decides (`keep_group`): "error"
stops the run with a message naming the reward and the prompt's line; "skip" gives the whole
group of that prompt zero advantages (its mean and std are undefined), so the group's samples
still fill the same rows as always (batch shapes, packing and the sampling seeds do not change)
but teach nothing, and `rollout/bad_rewards` counts the bad rewards. A step whose every group
is skipped this way has only zero advantages and makes no update (steps/rl.py).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Sequence

from fnt.config.references import import_function, require_function
from fnt.errors import ConfigError, UserCodeError, named
from fnt.rollout.user_code import call_user, shown

RewardFn = Callable[[str, Mapping[str, Any]], float]


def _answer(sample: Mapping[str, Any]) -> str:
    if "answer" not in sample:
        raise ValueError(
            f"this reward compares with the record's 'answer' field, but the prompt record has "
            f"only {sorted(sample)}"
        )
    return str(sample["answer"])


def similarity(completion: str, sample: Mapping[str, Any]) -> float:
    """difflib's SequenceMatcher ratio in [0, 1] between the completion and sample["answer"]."""
    return difflib.SequenceMatcher(None, completion, _answer(sample)).ratio()


def exact_match(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 when the completion equals sample["answer"] up to surrounding whitespace, else 0.0."""
    return float(completion.strip() == _answer(sample).strip())


def ascii_letters(completion: str, sample: Mapping[str, Any]) -> float:
    """The share of the completion's characters that are ASCII letters (0 when it is empty).

    Needs no answer, and even a randomly initialised model scores a spread of values, so it is
    the debugging reward: the advantages are non-zero from the first step.
    """
    if not completion:
        return 0.0
    return sum(ch.isascii() and ch.isalpha() for ch in completion) / len(completion)


REWARDS: Mapping[str, RewardFn] = MappingProxyType(
    {"ascii_letters": ascii_letters, "exact_match": exact_match, "similarity": similarity}
)
"""The registered rewards, by the name `rollout.reward` uses."""


REWARD_SHAPE = "a reward fn(completion: str, sample: dict) -> float"


def unknown_reward(name: str) -> str:
    """The message for a `rollout.reward` that is neither registered nor "module:function". Pure."""
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown reward {name!r}{hint}. Registered rewards: {', '.join(sorted(REWARDS))}; or give "
        f"'module:function' for your own fn(completion: str, sample: dict) -> float"
    )


def reward_function(name: str) -> RewardFn:
    """The reward function a `rollout.reward` value names: a REWARDS key or "module:function"."""
    if ":" in name:
        try:
            return import_function(name, 2)
        except ValueError as e:
            raise ValueError(f"reward {name!r}: {e}") from e
    if name in REWARDS:
        return REWARDS[name]
    raise ValueError(unknown_reward(name))


def require_reward(name: str, key: str = "rollout.reward") -> RewardFn:
    """`reward_function(name)`, or a ConfigError naming `key`: checked before any model is built,
    where the engine would otherwise find a misspelled or unimportable reward only after it."""
    if ":" in name:
        return require_function(name, key, 2, REWARD_SHAPE)
    if name not in REWARDS:
        raise ConfigError(f"{named(key, name)}: {unknown_reward(name)}")
    return REWARDS[name]


def score(
    texts: Sequence[str],
    record: Mapping[str, Any],
    reward_fn: RewardFn,
    reward_name: str,
    where: str,
) -> list[float]:
    """The reward of each completion text of one prompt record: the one place fnt calls a
    reward function (rollouts and evaluation alike). NaN and inf are returned as they are: what
    to do with them is rollout.on_bad_reward's (`keep_group`).

    An error of the reward function, or a reward that is not a real number, raises a
    UserCodeError (a ValueError) naming the reward, the completion and `where` (the prompt's
    line in its file), followed by the reward's own frames (fnt.rollout.user_code).
    """
    rewards = []
    for text in texts:
        what = f"reward {reward_name!r} failed on {where} (completion {shown(text)})"
        value = call_user(reward_fn, what, text, record)
        if not isinstance(value, numbers.Real):
            raise UserCodeError(
                f"reward {reward_name!r} returned {shown(value)} for {shown(text)} on {where}; "
                "expected a float"
            )
        rewards.append(float(value))
    return rewards


def keep_group(rewards: Sequence[float], policy: str, where: str, reward_name: str) -> bool:
    """Whether a group with these rewards trains: True when all are finite; with a NaN/inf among
    them, False under `rollout.on_bad_reward` = "skip" and a ValueError naming the reward, the
    value and `where` under "error"."""
    bad = [value for value in rewards if not math.isfinite(value)]
    if not bad:
        return True
    if policy == "skip":
        return False
    if policy != "error":
        raise ValueError(f"unknown rollout.on_bad_reward {policy!r}")
    raise ValueError(
        f"reward {reward_name!r} returned {bad[0]!r} on {where}; expected a finite float "
        '(rollout.on_bad_reward = "skip" trains on without that prompt\'s group)'
    )
