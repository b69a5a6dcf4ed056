"""The single-turn environment: the prompt record's messages, one model turn, the reward of its
text (rollout.reward). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments.protocol import Message, Reply, Start
from fnt.rollout.prompts import prompt_messages
from fnt.rollout.rewards import RewardFn


class SingleTurnEnvironment:
    """What `rollout.reward` alone has always meant: one completion per episode, scored by
    fn(completion, record)."""

    def __init__(self, reward: RewardFn) -> None:
        self.reward = reward

    def start(self, record: Mapping[str, Any]) -> Start:
        return Start(tuple(prompt_messages(record)))

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        return None

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> float:
        return self.reward(messages[-1]["content"], record)
