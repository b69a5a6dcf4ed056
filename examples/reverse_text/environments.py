"""Environments of the reverse-text task (rollout.environment =
"examples.reverse_text.environments:FACTORY", with the repository on PYTHONPATH). Pure.

feedback     a wrong reversal gets a hint, the first half of the true reversal ("Not quite: it
             starts with 'fed'."), and a second try (rollout.max_turns = 2); rewards "final"
             (the last answer's similarity, trained on) and "first" (logged). The multi-turn
             demo (demo_multiturn.py) trains with it.
three_turns  every answer gets the hint until the third; the episode ends after three model
             turns. scripts/bench_rl.py --multi-turn times it against single-turn episodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments import FeedbackEnvironment, Reply
from fnt.rollout.environments.protocol import Message
from fnt.rollout.rewards import similarity


def hint(answer: str, record: Mapping[str, Any]) -> str:
    """The first half (rounded up) of the true reversal."""
    truth = str(record["answer"])
    return f"Not quite: it starts with '{truth[: (len(truth) + 1) // 2]}'."


def feedback(rollout) -> FeedbackEnvironment:
    return FeedbackEnvironment(similarity, hint, threshold=1.0)


class ThreeTurns(FeedbackEnvironment):
    """The feedback environment's hints after every answer but the third, whatever it was."""

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if len(answers) >= 3:
            return None
        return Reply(({"role": "user", "content": self.hint(answers[-1], record)},))


def three_turns(rollout) -> ThreeTurns:
    return ThreeTurns(similarity, hint)
