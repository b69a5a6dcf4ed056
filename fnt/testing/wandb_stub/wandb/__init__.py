"""A stand-in for the `wandb` package, for tests (fnt.testing.WANDB_STUB: put this directory
first on PYTHONPATH, or first on sys.path before W&B is imported). Side effects: sleeps, and
files under $SLOW_WANDB_HISTORY.

Each `log` takes $SLOW_WANDB_LOG_SECONDS (default 0; 30 plays a W&B service that hangs). With
$SLOW_WANDB_HOLD_AFTER = N, a process's logs after its N-th never return (a W&B that has fallen
behind, whatever the speed of training).

With $SLOW_WANDB_HISTORY (a directory) it also keeps each run's history there, as the W&B
server would, across processes: `{id}.json` maps steps to values; `resume_from` rewinds a run
to its step, `fork_from` copies a run's history up to its step, and a log of a step the run
has already passed is dropped. A test can then kill a run and compare what "W&B" holds with
metrics.jsonl (tests/e2e/test_wandb_run.py, fnt.testing.assert_one_row_per_step).
"""

import json
import os
import time
import uuid
from pathlib import Path

LOG_SECONDS = float(os.environ.get("SLOW_WANDB_LOG_SECONDS", "0"))
HISTORY = os.environ.get("SLOW_WANDB_HISTORY")
HOLD_AFTER = os.environ.get("SLOW_WANDB_HOLD_AFTER")


def _path(run_id):
    return Path(HISTORY) / f"{run_id}.json"


def _read(run_id):
    path = _path(run_id)
    return {int(s): v for s, v in json.loads(path.read_text()).items()} if path.exists() else {}


def _write(run_id, history):
    tmp = _path(run_id).with_suffix(".tmp")
    tmp.write_text(json.dumps({str(s): v for s, v in sorted(history.items())}))
    os.replace(tmp, _path(run_id))


def _split(point):
    run_id, step = point.split("?_step=")
    return run_id, int(step)


class Table(dict):
    """wandb.Table(columns=..., data=...), kept as the JSON the history file holds."""

    def __init__(self, columns, data):
        super().__init__(_type="table", columns=list(columns), data=[list(row) for row in data])


class Run:
    def __init__(self, run_id):
        self.id = run_id
        self.logged = 0

    def log(self, values, step):
        if HOLD_AFTER is not None and self.logged >= int(HOLD_AFTER):
            while True:
                time.sleep(1)
        time.sleep(LOG_SECONDS)
        self.logged += 1
        if HISTORY:
            history = _read(self.id)
            if not history or step > max(history):
                history[step] = values
                _write(self.id, history)

    def finish(self):
        pass


def init(**kwargs):
    if "resume_from" in kwargs:
        run_id, step = _split(kwargs["resume_from"])
        if HISTORY:
            _write(run_id, {s: v for s, v in _read(run_id).items() if s <= step})
        return Run(run_id)
    run_id = kwargs.get("id") or uuid.uuid4().hex[:12]
    if HISTORY:
        history = {}
        if "fork_from" in kwargs:
            source, step = _split(kwargs["fork_from"])
            history = {s: v for s, v in _read(source).items() if s <= step}
        _write(run_id, history)
    return Run(run_id)
