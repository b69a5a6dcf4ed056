"""Environments for the multi-turn tests, named by rollout.environment =
"tests.fnt.rollout.multi_turn_env:FACTORY". Pure."""

from __future__ import annotations

from fnt.rollout.environments import FeedbackEnvironment, ToolEnvironment
from fnt.rollout.rewards import ascii_letters


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def broken(x: str) -> str:
    """A tool that always fails."""
    raise RuntimeError(f"broken on {x!r}")


def feedback(rollout):
    """The tiny model rarely writes only letters: most episodes get a hint and try again."""
    return FeedbackEnvironment(ascii_letters, threshold=0.95)


def tools(rollout):
    return ToolEnvironment([add, broken], ascii_letters, system="Use the tools.")


def half_letters(answer: str, record) -> float:
    """ascii_letters, but 1 (a pass) once at least half the answer is letters."""
    share = ascii_letters(answer, record)
    return 1.0 if share >= 0.5 else share


def lenient_feedback(rollout):
    """feedback, with answers of half letters or more right: some samples pass, some do not."""
    return FeedbackEnvironment(half_letters, threshold=1.0)


def accepting_feedback(rollout):
    """feedback that accepts every answer: each episode is one model turn."""
    return FeedbackEnvironment(ascii_letters, threshold=0.0)
