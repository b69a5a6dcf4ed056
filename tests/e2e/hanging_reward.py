"""A reward that hangs for good after $HANG_AFTER_CALLS calls, on the rank $HANG_RANK (default
0): a step stuck in user code, which a preemption's grace period must end
(tests/e2e/test_grace_period.py). Without $HANG_AFTER_CALLS it is the ascii_letters reward."""

from __future__ import annotations

import os
import threading

from fnt.rollout.rewards import REWARDS

calls = 0


def reward(completion: str, sample: dict) -> float:
    global calls
    calls += 1
    limit = os.environ.get("HANG_AFTER_CALLS")
    if (
        limit
        and calls > int(limit)
        and os.environ.get("RANK", "0") == os.environ.get("HANG_RANK", "0")
    ):
        threading.Event().wait()  # never set
    return REWARDS["ascii_letters"](completion, sample)
