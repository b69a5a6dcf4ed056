"""The best checkpoint (ckpt.keep_best): which complete checkpoint's step has the lowest (or
highest) value of a row key. Pure, except `read_step_rows` and `best_checkpoint`, which read
metrics.jsonl and list checkpoints/, and `prune_checkpoints_`, which deletes the checkpoints
ckpt.keep_last and ckpt.keep_best do not keep. Imports nothing heavy (`fnt inspect` names the
best too).

The best is never remembered, only found again: from the rows on disk (metrics.jsonl, where row
N is written before step_N is committed) and the complete checkpoints. Pruning keeps it beside
the newest keep_last, so the best of the checkpoints that remain is always the best of all the
run saved, across crashes and resumes. Ties go to the earlier step (a later one must improve).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Optional, Union

from fnt.config.schema import keep_best_rule
from fnt.store.rundir import (
    METRICS_FILE,
    ckpt_root,
    complete_steps,
    list_step_dirs,
    prune_steps_,
)


@dataclass(frozen=True)
class Best:
    """The best checkpoint's step, the row key and its value there, and the direction."""

    step: int
    key: str
    value: float
    mode: str
    """"min" or "max"."""

    def text(self) -> str:
        """`step_8 (val/loss 1.234, lowest)`."""
        way = "lowest" if self.mode == "min" else "highest"
        return f"step_{self.step} ({self.key} {self.value:.4g}, {way})"

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "key": self.key, "value": self.value, "mode": self.mode}


def best_step(
    rows: Mapping[int, Mapping[str, Any]], steps: Collection[int], keep_best: str
) -> Optional[Best]:
    """The best of the checkpoints `steps` by their rows (`rows`: step -> row) under the
    ckpt.keep_best rule; None when the rule is off or no checkpoint's row has a finite value of
    the key. Pure."""
    if not keep_best:
        return None
    key, mode = keep_best_rule(keep_best)
    best: Optional[Best] = None
    for step in sorted(steps):
        value = rows.get(step, {}).get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        better = best is None or (value < best.value if mode == "min" else value > best.value)
        if better:
            best = Best(step, key, float(value), mode)
    return best


def read_step_rows(output_dir: Union[str, Path], steps: Collection[int]) -> dict[int, dict]:
    """The rows of metrics.jsonl whose step is in `steps`, by step (the last of a step's rows, as
    a resume keeps); lines that are not rows (a crash's cut last line) are passed over."""
    path = Path(output_dir) / METRICS_FILE
    wanted, rows = set(steps), {}
    if not wanted or not path.is_file():
        return rows
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("step") in wanted:
                rows[row["step"]] = row
    return rows


def best_checkpoint(output_dir: Union[str, Path], keep_best: str) -> Optional[Best]:
    """The best complete checkpoint of a run directory under the ckpt.keep_best rule, found
    from its rows on disk; None when the rule is off or no checkpoint qualifies."""
    if not keep_best:
        return None
    steps = complete_steps(list_step_dirs(ckpt_root(output_dir)))
    return best_step(read_step_rows(output_dir, steps), steps, keep_best)


def best_text(output_dir: Union[str, Path], keep_best: str) -> Optional[str]:
    """What the end summary says of the best checkpoint: `Best.text`, or why there is none;
    None when ckpt.keep_best is off."""
    if not keep_best:
        return None
    best = best_checkpoint(output_dir, keep_best)
    if best is None:
        key, _ = keep_best_rule(keep_best)
        return f"none (no checkpoint's row has a value of {key})"
    return best.text()


def prune_checkpoints_(
    output_dir: Union[str, Path], keep_last: int, keep_best: str
) -> Optional[Best]:
    """Apply ckpt.keep_last to the run's checkpoints, keeping the best one (ckpt.keep_best)
    beside the newest keep_last (fnt.store.rundir.prune_steps_); returns the best."""
    best = best_checkpoint(output_dir, keep_best)
    prune_steps_(ckpt_root(output_dir), keep_last, () if best is None else (best.step,))
    return best
