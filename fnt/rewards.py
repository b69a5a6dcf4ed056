"""Reward functions for RL rollouts, looked up by name. Pure, except that resolving a
"module:function" name imports that module.

A reward function is `fn(completion: str, sample: dict) -> float`: `completion` is the generated
text decoded without special tokens (so without the closing eos), `sample` is the prompt's JSONL
record with all its fields (e.g. "answer"). `reward_function(name)` resolves either a name in
REWARDS or a "module:function" string naming any importable function of that shape.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

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


def reward_function(name: str) -> RewardFn:
    """The reward function a `rollout.reward` value names: a REWARDS key or "module:function"."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {e}") from e
        fn = getattr(module, attr, None)
        if fn is None:
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        if not callable(fn):
            raise ValueError(f"reward {name!r}: {module_name}.{attr} is not callable")
        return fn
    if name in REWARDS:
        return REWARDS[name]
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown reward {name!r}{hint}. Registered rewards: {', '.join(sorted(REWARDS))}; or give "
        f"'module:function' for your own fn(completion: str, sample: dict) -> float"
    )
