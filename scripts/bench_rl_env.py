"""The long-tailed environment of `scripts/bench_rl.py --long-tail`: reverse-text episodes of 1 to
8 turns whose every call takes time. Side effects: `respond` sleeps (the call's latency) and
adds what it slept to a process-wide total (`slept_seconds`).

How many model turns an episode runs is decided by its prompt record alone (a CRC32 of the
prompt text into TURN_WEIGHTS): most episodes are short, a few run 8 turns, and every episode of
a group runs as many turns, so both schedules of the benchmark see the same episodes. Every
answer but the last gets the reverse-text task's hint (examples/reverse_text/environments.py)
whatever it was, as `three_turns` does; the reward is the last answer's similarity.

Each `respond` call sleeps LATENCY_MS (a tool or a sandbox answering), and one call in
SLOW_ONE_IN takes SLOW_FACTOR times as long; which ones is again a function of the record and
the turn, so the two schedules wait for the same calls. What it sleeps never changes what it
answers: the environment stays a deterministic function of its arguments.

    rollout.environment = "scripts.bench_rl_env:long_tail", rollout.max_turns = 8
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from examples.reverse_text.environments import hint
from fnt.rollout.environments import FeedbackEnvironment, Reply
from fnt.rollout.environments.protocol import Message
from fnt.rollout.rewards import similarity

# Share (in percent) of prompt records whose episodes run 1, 2, ..., 8 turns: long-tailed.
TURN_WEIGHTS = (40, 20, 14, 10, 6, 4, 3, 3)
MAX_TURNS = len(TURN_WEIGHTS)
LATENCY_MS = 20
SLOW_ONE_IN = 8
SLOW_FACTOR = 5


_slept = 0.0  # seconds all `respond` calls of the process slept: slept_seconds()
_slept_lock = threading.Lock()  # calls may run in threads (rollout.env_concurrency)


def slept_seconds() -> float:
    """Seconds every LongTail's `respond` calls in this process have slept so far (the latency
    a step waited for, were its calls made one after another)."""
    return _slept


def _hash(*parts: object) -> int:
    return zlib.crc32("\x1f".join(str(p) for p in parts).encode())


def episode_turns(record: Mapping[str, Any]) -> int:
    """How many model turns the record's episodes run, 1 to MAX_TURNS (TURN_WEIGHTS). Pure."""
    bucket = _hash(record["prompt"]) % sum(TURN_WEIGHTS)
    for turns, weight in enumerate(TURN_WEIGHTS, start=1):
        if bucket < weight:
            return turns
        bucket -= weight
    raise AssertionError("unreachable: the buckets cover the hash's range")


def call_latency(record: Mapping[str, Any], turn: int, latency_ms: float) -> float:
    """Seconds the `respond` call after model turn `turn` (1-based) of the record takes. Pure."""
    slow = _hash(record["prompt"], turn) % SLOW_ONE_IN == 0
    return latency_ms * (SLOW_FACTOR if slow else 1) / 1000


class LongTail(FeedbackEnvironment):
    """Hints until the record's `episode_turns` answers, each call after `call_latency`."""

    def __init__(self, latency_ms: float) -> None:
        super().__init__(similarity, hint)
        self.latency_ms = latency_ms
        self.reward_weights = {"final": 1.0, "first": 0.0}

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        seconds = call_latency(record, len(answers), self.latency_ms)
        time.sleep(seconds)
        global _slept
        with _slept_lock:
            _slept += seconds
        if len(answers) >= episode_turns(record):
            return None
        return Reply(({"role": "user", "content": self.hint(answers[-1], record)},))


def long_tail(rollout) -> LongTail:
    """The environment factory (rollout.environment = "scripts.bench_rl_env:long_tail")."""
    return LongTail(LATENCY_MS)
