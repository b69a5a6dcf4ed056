"""Several two-rank jobs in one torchrun launch (the `two_rank_runs` fixture of tests/conftest.py).

usage: torchrun --standalone --nproc-per-node 2 -m tests.two_ranks JOBS.json

A torchrun launch costs seconds of interpreter start-up and imports on every rank, far more than
a tiny two-rank job itself; one launch for all of them costs that once. JOBS.json is a list of
{"name", "call": "module:function", "args": [...], "out": DIR}: every rank calls
`function(*args)` in order, in one process group made here first (fnt's setup_trainer then
reuses it, and teardown_trainer leaves it alone:
fnt.distributed.runtime.Runtime.owns_process_group), with its stdout and stderr in
DIR/rank{R}.log. A job that returns writes DIR/rank{R}.done. One that raises writes its
traceback to DIR/rank{R}.error and ends the launch: the other rank may be waiting for it in a
collective, and the jobs after it never run (their tests then say so).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist


def run_job(job: dict, rank: int) -> None:
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    module, function = job["call"].split(":")
    target = getattr(importlib.import_module(module), function)
    with open(out / f"rank{rank}.log", "w") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                target(*job["args"])
            except SystemExit as exc:  # a command's exit status: kept, as a test may expect 2
                if exc.code not in (0, None):
                    (out / f"rank{rank}.exit").write_text(f"{exc.code}\n")
    (out / f"rank{rank}.done").write_text("")


def main(jobs_file: str) -> None:
    jobs = json.loads(Path(jobs_file).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    for job in jobs:
        try:
            run_job(job, rank)
        except BaseException:
            error = traceback.format_exc()
            (Path(job["out"]) / f"rank{rank}.error").write_text(error)
            print(f"rank {rank}: job {job['name']} failed\n{error}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
