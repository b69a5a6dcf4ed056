"""Fault injection for the crash tests. Side effect: `fault_point` may SIGKILL this process.

`FNT_FAULT="PHASE@STEP"` or `"PHASE@STEP:RANK"` makes the process of rank RANK (default 0) kill
itself with SIGKILL, the way a power cut or the OOM killer would, when it reaches PHASE at step
STEP. Unset in normal runs, where each point costs one environment lookup. The phases, in the
order a step passes them (fnt.loop, fnt.checkpoint, fnt.obs.monitors):

    step       step STEP's update is done, its row not yet written
    row        row STEP is written and fsynced, step_STEP's checkpoint not yet begun
    wandb      inside W&B's log call of row STEP (on W&B's thread; rank 0 only)
    shards     this rank's DCP files of step_STEP are written, the marker is not
    marker     step_STEP's marker is written, the directory not yet renamed (rank 0)
    committed  step_STEP is renamed into place, older checkpoints not yet cleaned up (rank 0)
    cleanup    keep_last cleanup has removed step_STEP's marker, not yet the directory (rank 0)
"""

from __future__ import annotations

import os
import signal
from typing import NamedTuple

FAULT_ENV = "FNT_FAULT"
PHASES = ("step", "row", "wandb", "shards", "marker", "committed", "cleanup")


class Fault(NamedTuple):
    phase: str
    step: int
    rank: int


def parse_fault(spec: str) -> Fault:
    """The fault `spec` names; ValueError for a spec that names no point. Pure."""
    where, colon, rank = spec.partition(":")
    phase, _, step = where.partition("@")
    if phase not in PHASES or not step.isdigit() or not (rank.isdigit() or not colon):
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected PHASE@STEP or PHASE@STEP:RANK with PHASE one of "
            f"{', '.join(PHASES)}"
        )
    return Fault(phase, int(step), int(rank or 0))


def fault_point(phase: str, step: int, rank: int = 0) -> None:
    """SIGKILL this process if FNT_FAULT names this point."""
    spec = os.environ.get(FAULT_ENV)
    if spec and parse_fault(spec) == Fault(phase, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
