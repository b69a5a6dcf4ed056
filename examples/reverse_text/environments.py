"""Environments of the reverse-text task (rollout.environment =
"examples.reverse_text.environments:FACTORY", with the repository on PYTHONPATH). Pure.

feedback     a wrong reversal gets a hint, the first half of the true reversal ("Not quite: it
             starts with 'fed'."), and a second try (rollout.max_turns = 2); rewards "final"
             (the last answer's similarity, trained on) and "first" (logged). The multi-turn
             demo (demo_multiturn.py) trains with it.
three_turns  every answer gets the hint until the third; the episode ends after three model
             turns. scripts/bench_rl.py --multi-turn times it against single-turn episodes.
lookup_tool  the tool task: "reverse the word under key 4821"; the word is only known to the
             tool `lookup` (a fixed function of the key the model cannot guess), so the model
             must call it (Hermes <tool_call> JSON) and answer with the reversal of its result
             (rollout.max_turns = 2); reward: similarity to the reversal. demo_multiturn.py
             trains it after an SFT stage on tool transcripts (`tool_transcript`).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments import FeedbackEnvironment, Reply, ToolEnvironment
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


LOOKUP_PROMPT = "reverse the word under key "


def lookup(key: str) -> str:
    """The word stored under a key.

    Args:
        key: the key the user names
    """
    # 4-10 letters, as the reverse-text data's: a fixed function of the key that a model cannot
    # compute (a seeded generator), so only the tool knows it.
    rng = random.Random(f"reverse-text word {key}")
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))


def lookup_record(key: str) -> dict[str, str]:
    """A prompt of the tool task, with the answer its reward compares against."""
    return {"prompt": LOOKUP_PROMPT + key, "answer": lookup(key)[::-1]}


def lookup_call(key: str) -> str:
    """The model turn that calls the tool, in the Hermes format ToolEnvironment parses."""
    call = {"name": "lookup", "arguments": {"key": key}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_transcript(key: str) -> list[dict[str, str]]:
    """A whole episode of the tool task done right: the call, the tool's answer, the reversal."""
    return [
        {"role": "user", "content": LOOKUP_PROMPT + key},
        {"role": "assistant", "content": lookup_call(key)},
        {"role": "tool", "name": "lookup", "content": lookup(key)},
        {"role": "assistant", "content": lookup(key)[::-1]},
    ]


def lookup_tool(rollout) -> ToolEnvironment:
    return ToolEnvironment([lookup], similarity)
