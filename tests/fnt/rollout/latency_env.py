"""Environments whose answers take time, for the tests of episodes that advance on their own,
named by rollout.environment = "tests.fnt.rollout.latency_env:FACTORY". Side effects: they sleep,
and record when each call started and ended."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from fnt.rollout.environments import FeedbackEnvironment
from fnt.rollout.rewards import ascii_letters


class TimedFeedback(FeedbackEnvironment):
    """tests.fnt.rollout.multi_turn_env:feedback whose `respond` first sleeps `delay(turn)`
    seconds and records (turn, start, end, delay) of every call in `calls`."""

    def __init__(self, delay) -> None:
        super().__init__(ascii_letters, threshold=0.95)
        self.delay, self.calls, self.lock = delay, [], threading.Lock()

    def respond(self, record, messages):
        turn = sum(m["role"] == "assistant" for m in messages)
        start = time.monotonic()
        delay = self.delay(turn)
        time.sleep(delay)
        with self.lock:
            self.calls.append((turn, start, time.monotonic(), delay))
        return super().respond(record, messages)


def jittery(rollout):
    """Every answer takes 0 to 30 ms, at random (not seeded: the timing differs run to run)."""
    return TimedFeedback(lambda turn: random.uniform(0.0, 0.03))


def one_slow_call(rollout):
    """The first answer the environment is asked for takes 0.6 s, every other none."""
    asked = []
    first = threading.Lock()

    def delay(turn):
        with first:
            asked.append(turn)
            return 0.6 if len(asked) == 1 else 0.0

    return TimedFeedback(delay)


class AsyncFeedback(FeedbackEnvironment):
    """feedback whose `respond` is a coroutine that awaits a short sleep."""

    def __init__(self) -> None:
        super().__init__(ascii_letters, threshold=0.95)

    async def respond(self, record, messages):
        await asyncio.sleep(random.uniform(0.0, 0.01))
        return FeedbackEnvironment.respond(self, record, messages)


def async_feedback(rollout):
    return AsyncFeedback()


class SlowScores(TimedFeedback):
    """feedback whose `score` takes 50 ms; records (start, end) of every score in `scores`."""

    def __init__(self) -> None:
        super().__init__(lambda turn: 0.0)
        self.scores = []

    def score(self, record, messages):
        start = time.monotonic()
        time.sleep(0.05)
        with self.lock:
            self.scores.append((start, time.monotonic()))
        return super().score(record, messages)


def slow_scores(rollout):
    return SlowScores()
