"""A stand-in for the `wandb` package whose every `log` takes 30 s (a W&B service that hangs),
or $SLOW_WANDB_LOG_SECONDS.

Put this directory first on PYTHONPATH to use it; see tests/e2e/test_wandb_run.py.
"""

import os
import time
import uuid

LOG_SECONDS = float(os.environ.get("SLOW_WANDB_LOG_SECONDS", "30"))


class Run:
    def __init__(self, run_id):
        self.id = run_id

    def log(self, values, step):
        time.sleep(LOG_SECONDS)

    def finish(self):
        pass


def init(**kwargs):
    return Run(kwargs.get("id") or uuid.uuid4().hex[:12])
