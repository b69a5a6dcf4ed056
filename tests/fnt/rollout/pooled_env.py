"""An environment that misbehaves on request, for the pooled-environment tests: its `respond`
crashes, segfaults, hangs, loops, allocates or raises when the model's turn says so. Side
effects: the process that runs it exits, sleeps or allocates when asked (run it in a worker)."""

from __future__ import annotations

import os
import signal
import time

from fnt.rollout.environments import Reply, Start


class Misbehaving:
    """Two model turns an episode; `score` is 1.0 when the last turn says "good"."""

    def start(self, record):
        return Start(({"role": "user", "content": record["prompt"]},))

    def respond(self, record, messages):
        text = messages[-1]["text"]
        if "crash" in text:
            os._exit(3)
        if "segfault" in text:
            os.kill(os.getpid(), signal.SIGSEGV)
        if "hang" in text:
            time.sleep(600)
        if "loop" in text:
            while True:
                pass
        if "alloc" in text:
            block = bytearray(512 * 1024 * 1024)
            return Reply(({"role": "user", "content": f"allocated {len(block)}"},))
        if "raise" in text:
            raise ValueError("the environment's own bug")
        if sum(m["role"] == "assistant" for m in messages) >= 2:
            return None
        return Reply(({"role": "user", "content": "again"},))

    def score(self, record, messages):
        return 1.0 if "good" in messages[-1]["text"] else 0.0


def build(rollout):
    return Misbehaving()
