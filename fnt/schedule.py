"""Learning-rate schedules as pure functions of the step. Pure.

`lr_at(step, ...)` is the rate used by update number `step` (1-based; docs/design.md, "Step
numbering"), so a resumed run derives the same rate with no scheduler state to checkpoint.
"""

from __future__ import annotations

import math

from fnt.config import ScheduleConfig


def lr_at(step: int, peak_lr: float, schedule: ScheduleConfig, max_steps: int) -> float:
    """Warmup linearly to `peak_lr` over `warmup_steps`, then constant, linear or cosine decay.

    Warmup: step 1 uses peak/warmup, step `warmup_steps` uses peak. Decay runs from the end of
    warmup to `max_steps`, where linear and cosine reach exactly `min_lr`.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first update is step 1), got {step}")
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * step / warmup
    if step == warmup:
        return peak_lr  # exactly, not peak * warmup / warmup with its rounding
    if schedule.kind == "constant":
        return peak_lr
    decay_steps = max_steps - warmup
    if decay_steps <= 0:
        return peak_lr
    done = min(1.0, (step - warmup) / decay_steps)
    if schedule.kind == "linear":
        shape = 1.0 - done
    elif schedule.kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * done))
    else:
        raise ValueError(f"unknown schedule kind {schedule.kind!r}")
    return schedule.min_lr + (peak_lr - schedule.min_lr) * shape
