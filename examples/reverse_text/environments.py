"""Environments of the reverse-text task (rollout.environment =
"examples.reverse_text.environments:FACTORY", with the repository on PYTHONPATH). Pure.

feedback     a wrong reversal gets a hint, the first half of the true reversal ("Not quite: it
             starts with 'fed'."), and a second try (rollout.max_turns = 2); rewards "final"
             (the last answer's similarity, trained on) and "first" (logged). The multi-turn
             demo (demo_multiturn.py) trains with it.
three_turns  every answer gets the hint until the third; the episode ends after three model
             turns. scripts/bench_rl.py --multi-turn times it against single-turn episodes.
lookup_tool  the tool task: "reverse the hidden word"; only the tool `lookup()` knows the word
             (the prompt record's, never shown), so the model must call it (Hermes
             <tool_call> JSON) and answer with the reversal of its result
             (rollout.max_turns = 2); reward: similarity to the reversal. demo_multiturn.py
             trains it after an SFT stage on tool transcripts (`tool_transcript`).
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments import FeedbackEnvironment, Reply, ToolEnvironment
from fnt.rollout.environments.protocol import Message, Start
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


LOOKUP_PROMPT = "reverse the hidden word"


def hidden_word(rng: random.Random) -> str:
    """A word of the tool task: 4-10 letters, as the reverse-text data's."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))


def lookup_record(word: str) -> dict[str, str]:
    """A prompt of the tool task: the same question every time; the word is only in the record
    (for the tool) and its reversal is the answer the reward compares against."""
    return {"prompt": LOOKUP_PROMPT, "word": word, "answer": word[::-1]}


LOOKUP_CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'


def tool_transcript(word: str) -> list[dict[str, str]]:
    """A whole episode of the tool task done right: the call, the tool's answer, the reversal."""
    return [
        {"role": "user", "content": LOOKUP_PROMPT},
        {"role": "assistant", "content": LOOKUP_CALL},
        {"role": "tool", "name": "lookup", "content": word},
        {"role": "assistant", "content": word[::-1]},
    ]


class LookupTool:
    """The tool task's environment: a ToolEnvironment per prompt record whose one tool,
    `lookup()`, returns the record's hidden word; the reward is the answer's similarity to its
    reversal. The prompt never shows the word, so only an episode that calls the tool can
    answer right."""

    reward_weights: dict[str, float] = {}

    def tools(self, record: Mapping[str, Any]) -> ToolEnvironment:
        def lookup() -> str:
            """The hidden word of this task."""
            return str(record["word"])

        return ToolEnvironment([lookup], similarity)

    def start(self, record: Mapping[str, Any]) -> Start:
        return self.tools(record).start(record)

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        return self.tools(record).respond(record, messages)

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> float:
        return similarity(messages[-1]["content"], record)


def lookup_tool(rollout) -> LookupTool:
    return LookupTool()
