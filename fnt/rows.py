"""The one metrics row of each step: `log_step_metrics` makes it (the step's own metrics with the
shared groups) and `RowBuilder` gives it what the driver measured.
Side effects: evaluations (fnt.evaluation.Evaluation: forward passes, collectives), a clock
and a disk-usage query per row; the groups themselves are fnt.obs.metrics' pure builders.

A row carries, besides the step function's metrics: progress/* (from Progress), perf/* (this
step's tokens over its time, MFU, peak memory), the timing the loop measured (time/step and the
hooks'), time/save_ckpt (the save after the previous step: row N is written before step N's
save), system/ckpt_disk_*, and the held-out metrics (fnt.evaluation.Evaluation, calling the
state's `val` handle, an fnt.state.Evaluator: which rows get val/*, val/start/* and time/val is
its module's docstring). Every row of a run with model.compile has time/compile, the seconds
the process spent compiling since the previous row's evaluations (the step, its source and the
save after the previous row; fnt.model.compile), which perf/* leave out, and
perf/compile_graphs, the graphs compiled in that time. An evaluation's compiling counts in its
time/val.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from fnt.evaluation import Evaluation
from fnt.model.compile import compile_totals
from fnt.model.loading import model_facts
from fnt.obs.metrics import (
    disk_metrics,
    flops_per_token,
    merge_metrics,
    peak_flops_per_device,
    peak_memory_gib,
    perf_metrics,
    step_row,
    to_floats,
)
from fnt.state import Progress, TrainState
from fnt.store.rundir import ckpt_root

if TYPE_CHECKING:
    from fnt.distributed.runtime import Runtime
    from fnt.obs.monitors import Monitors


def log_step_metrics(
    step: int,
    metrics: Mapping[str, Any],
    *,
    runtime: Runtime,
    step_time: float,
    num_tokens: int,
    flops_per_token: float = 0.0,
    peak_flops: float = 0.0,
    progress: Optional[Progress] = None,
    ckpt_dir: Union[str, Path, None] = None,
    timing: Optional[Mapping[str, float]] = None,
    monitors: Optional[Monitors] = None,
) -> dict[str, Any]:
    """The one row of `step`, and with `monitors` that row logged in one call; returns the row.

    The row holds `step` and `time`, the shared metrics and the step function's `metrics`
    (tensors become floats here: the step's one host sync): perf/* (`num_tokens` over
    `step_time` seconds, less the time/compile of `timing`, on the runtime's world size, MFU
    from `flops_per_token` and the device's `peak_flops`, peak memory), time/step and the
    other time/* keys of `timing`,
    system/ckpt_disk_* of the filesystem of `ckpt_dir`, and progress/* of `progress`. The
    driver's rows are made here too (`RowBuilder.row`), so a loop of your own that calls this
    writes the rows `fnt sft` and `fnt rl` write. Side effects: the clock, the peak-memory and
    disk-usage queries, and the monitors.
    """
    perf = perf_metrics(
        num_tokens,
        step_time - (timing or {}).get("time/compile", 0.0),
        runtime.world_size,
        flops_per_token,
        peak_flops,
        peak_memory_gib(runtime.device),
    )
    row = step_row(
        step,
        time.time(),
        perf,
        {"time/step": step_time, **(timing or {})},
        disk_metrics(Path(ckpt_dir)) if ckpt_dir is not None else {},
        merge_metrics(to_floats(metrics), progress_metrics(progress) if progress else {}),
    )
    if monitors is not None:
        monitors.log(row)
    return row


def progress_metrics(progress: Progress) -> dict[str, float]:
    """progress/* keys of a row, derived from Progress. Pure."""
    return {
        "progress/epoch": float(progress.data.epoch),
        "progress/num_samples": float(progress.total_samples),
        "progress/num_tokens": float(progress.total_tokens),
    }


class RowBuilder:
    """Built with a run's start state (with val.eval_on_start, that state is evaluated here);
    `row(state, metrics, timing)` then makes each step's row, once per step, in order."""

    def __init__(self, state: TrainState) -> None:
        config, runtime = state.config, state.handles.runtime
        self.runtime = runtime
        self.evaluation = Evaluation(state)
        self.peak_flops = peak_flops_per_device(config.runtime.peak_tflops, runtime.device)
        facts = model_facts(state.handles.model)
        self.flops_per_token = flops_per_token(
            facts.num_params,
            facts.num_layers,
            facts.hidden_size,
            config.seq_len,
            facts.frozen_params,
        )
        self.tokens_before = state.progress.total_tokens
        self.save_seconds = 0.0
        self.compiled = compile_totals() if config.model.compile else None

    def row(
        self, state: TrainState, metrics: Mapping[str, Any], timing: Mapping[str, float]
    ) -> dict[str, Any]:
        """The row of the step `state` completed; `metrics` are the step function's, `timing`
        has time/step and the loop's other time/* keys."""
        progress = state.progress
        tokens, self.tokens_before = (
            progress.total_tokens - self.tokens_before,
            progress.total_tokens,
        )
        compiling: dict[str, float] = {}
        if self.compiled is not None:
            compiled = compile_totals() - self.compiled
            timing = {**timing, "time/compile": compiled.seconds}
            compiling = {"perf/compile_graphs": float(compiled.graphs)}
        evaluation = self.evaluation.row_metrics(state)  # evaluates when the step is due
        if self.compiled is not None:
            self.compiled = compile_totals()
        row = log_step_metrics(
            progress.step,
            merge_metrics(to_floats(metrics), evaluation, compiling),
            runtime=self.runtime,
            step_time=timing["time/step"],
            num_tokens=tokens,
            flops_per_token=self.flops_per_token,
            peak_flops=self.peak_flops,
            progress=progress,
            ckpt_dir=ckpt_root(state.config.output_dir),
            timing={**timing, "time/save_ckpt": self.save_seconds},
        )
        self.save_seconds = 0.0
        return row

    def saved(self, seconds: float) -> None:
        """The checkpoint after the last row took `seconds`: the next row carries them."""
        self.save_seconds = seconds
