"""A run's saved RL samples: `{output_dir}/samples/step_N.jsonl`, every completion of step N
with its prompt, reward, token ids and the [start, end) offsets of the spans it trained
(fnt.rollout.saved_samples), on the steps `rollout.log_samples_every` picks. Side effects:
writes, reads and deletes those files; `is_sample_step` and `sample_steps_every` are pure.

Rank 0 writes a step's file whole (all ranks' samples, gathered in rank order, so the file is in
the step's prompt order), before the step's metrics row and so before its checkpoint: into a
temporary file, fsynced, then renamed into place. A crash leaves the whole file or none, and a
run resumed from step M first deletes the files of steps after M (`drop_samples_after_`), which
it redoes: a step's file is neither lost nor kept twice, and it belongs to the trajectory that
metrics.jsonl and the checkpoints hold. The monitors read the files back (the console shows a
few completions, W&B a table), and so does `fnt show-rollouts --run` (the trained spans marked),
so every consumer sees the same samples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from fnt.store.rundir import SAMPLES_DIR, PathLike, step_of
from fnt.store.transaction import fsync_dir, write_synced_

SAMPLES_PER_RUN = 4
"""`rollout.log_samples_every = 0` saves the samples about this many times a run."""


def sample_steps_every(every: int, max_steps: int) -> int:
    """The interval between sample steps: `every` when set (> 0), 0 (never) when negative, else
    about SAMPLES_PER_RUN times in `max_steps`. Pure."""
    if every < 0:
        return 0
    if every > 0:
        return every
    return max(1, -(-max_steps // SAMPLES_PER_RUN))


def is_sample_step(step: int, every: int, max_steps: int) -> bool:
    """Whether step `step`'s samples are saved: a multiple of the interval
    (`sample_steps_every`), or the run's last step. Pure."""
    interval = sample_steps_every(every, max_steps)
    return interval > 0 and step > 0 and (step % interval == 0 or step == max_steps)


def samples_path(output_dir: PathLike, step: int) -> Path:
    """`{output_dir}/samples/step_N.jsonl`."""
    return Path(output_dir) / SAMPLES_DIR / f"step_{step}.jsonl"


def write_step_samples_(
    output_dir: PathLike, step: int, records: Sequence[Mapping[str, Any]]
) -> Path:
    """Write step `step`'s sample records as one JSON line each, replacing the file in one
    rename (module docstring); returns its path."""
    path = samples_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_synced_(tmp, "".join(json.dumps(record) + "\n" for record in records))
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def read_step_samples(output_dir: PathLike, step: int) -> Optional[list[dict]]:
    """Step `step`'s saved sample records, or None when it has no file."""
    path = samples_path(output_dir, step)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def saved_sample_steps(output_dir: PathLike) -> list[int]:
    """The steps that have a samples file, in order."""
    directory = Path(output_dir) / SAMPLES_DIR
    if not directory.is_dir():
        return []
    steps = [step_of(p.name[: -len(".jsonl")]) for p in directory.glob("step_*.jsonl")]
    return sorted(s for s in steps if s is not None)


def drop_samples_after_(output_dir: PathLike, start_step: int) -> list[str]:
    """Delete the samples files of the steps after `start_step` (a run starting there redoes
    them) and any unfinished temporary file; one line saying which, or none."""
    directory = Path(output_dir) / SAMPLES_DIR
    for tmp in directory.glob("step_*.jsonl.tmp") if directory.is_dir() else ():
        tmp.unlink()
    dropped = [s for s in saved_sample_steps(output_dir) if s > start_step]
    for step in dropped:
        samples_path(output_dir, step).unlink()
    if not dropped:
        return []
    fsync_dir(directory)
    steps = ", ".join(map(str, dropped))
    return [
        f"{directory}: deleted the samples of steps {steps}, after the step this run starts "
        "from (it redoes them)"
    ]
