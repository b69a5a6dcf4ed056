"""The feedback environment: a wrong answer gets a hint and another try. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments.protocol import Message, Reply, Start
from fnt.rollout.prompts import prompt_messages

DEFAULT_HINT = "That is not right. Try again."


def record_hint(text: str, record: Mapping[str, Any]) -> str:
    """The record's "hint" field, or DEFAULT_HINT."""
    return str(record.get("hint", DEFAULT_HINT))


class FeedbackEnvironment:
    """The prompt record's messages; after each model turn, `reward(answer, record)`: at least
    `threshold` ends the episode, below it the environment answers as the user with
    `hint(answer, record)` and the model tries again (up to rollout.max_turns).

    Named rewards: "final", the last answer's reward (weight 1), and "first", the first
    answer's (weight 0: logged, not trained on), so reward/first/mean against
    reward/final/mean shows what the extra turns bought.

    Turn rewards (rollout.credit = "turn", `score_turns`): each answer but the last costs its
    shortfall from `threshold`, the hint it made necessary; the last earns the score. So a
    right first answer is worth more than a right second one, and each turn's tokens are
    credited for their own answer rather than for the episode's last.
    """

    def __init__(
        self,
        reward: Callable[[str, Mapping[str, Any]], float],
        hint: Callable[[str, Mapping[str, Any]], str] = record_hint,
        *,
        threshold: float = 1.0,
    ) -> None:
        self.reward, self.hint, self.threshold = reward, hint, threshold
        self.reward_weights = {"final": 1.0, "first": 0.0}

    def start(self, record: Mapping[str, Any]) -> Start:
        return Start(tuple(prompt_messages(record)))

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        answer = messages[-1]["content"]
        if self.reward(answer, record) >= self.threshold:
            return None
        return Reply(({"role": "user", "content": self.hint(answer, record)},))

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> dict[str, float]:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "final": float(self.reward(answers[-1], record)),
            "first": float(self.reward(answers[0], record)),
        }

    def score_turns(self, record: Mapping[str, Any], messages: Sequence[Message]) -> list[float]:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        costs = [min(0.0, float(self.reward(a, record)) - self.threshold) for a in answers[:-1]]
        return [*costs, 0.0]
