"""The fold and the driver. Side effects: `run` has those of a whole training run (its
RunContext's, its RowBuilder's, its start state's, and the step function's, batch source's and
`on_state`'s it calls), saves and prunes checkpoints (`save_and_prune_`) and prints a line on
rank 0 after the last save; `newest_checkpoint` lists checkpoints/. `fold` is pure control flow.

`fold` is pure control flow: it threads a TrainState through a batch source and a step function.
`run` is the driver: the loop below, over a RunContext (fnt.run_context: signals, the launcher
watchdog, the run lock, the process group, monitors, profiler, closing the sources' handles) and
a RowBuilder (fnt.rows: one metrics row per step). The start state, fresh or resumed, is
fnt.start's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional

from fnt.build import save_state_
from fnt.checkpoint import should_checkpoint
from fnt.config import Config
from fnt.faults import fault_point
from fnt.obs.metrics import to_floats
from fnt.rows import RowBuilder
from fnt.run_context import RunContext
from fnt.sources import BatchSource
from fnt.start import start_state
from fnt.state import TrainState
from fnt.store.best import best_text, prune_checkpoints_
from fnt.store.rundir import ckpt_root, complete_steps, list_step_dirs, start_done, step_name

Metrics = dict[str, Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, Metrics]]


def fold(
    state: TrainState, source: BatchSource, step_fn: StepFn, steps: int
) -> Iterator[tuple[TrainState, Metrics]]:
    """Run `steps` updates: each asks `source` for the batch of the current state, then steps.

    Yields every successor state with its metrics. The source sees only the current state, so it
    can never produce a batch ahead of the state it belongs to.
    """
    for _ in range(steps):
        state, metrics = step_fn(state, source(state))
        yield state, metrics


def run(
    config: Config,
    step_fn: StepFn,
    source: BatchSource,
    *,
    on_state: Optional[Callable[[TrainState], Any]] = None,
) -> TrainState:
    """Train from the configured start (fresh or resumed) to `config.max_steps`; return the last
    state.

    `source(state)` gives the batch of the step after `state` (see fnt.sources). `on_state(state)`
    runs on every rank for the start state and after each update, before the checkpoint (e.g. to
    publish weights to an external rollout engine); its time is logged as time/after_step.

    Row N is on disk before step_N is committed: a kill in between resumes from an earlier
    checkpoint and rewrites the row, never from step_N with row N missing. After SIGTERM or
    SIGUSR1 the run checkpoints the step it is at and raises `Preempted`
    (fnt.run_context).
    """
    with RunContext(config) as ctx:
        state = start_state(config, ctx.runtime)
        config, ckpt = state.config, state.config.ckpt  # max_epochs resolved to max_steps
        ctx.begin_(state)
        rows = RowBuilder(state)  # with val.eval_on_start, evaluates the start state
        if on_state is not None:
            on_state(state)
            # The start's weights are published: an orchestrator or inference server may be
            # reading them, so a failure from here is the run's, and nothing of its start is undone.
            start_done(config.output_dir)
        started = time.perf_counter()
        for state, metrics in fold(state, source, step_fn, config.max_steps - state.progress.step):
            # The step's one transfer back from the device: a step function queues its work and
            # returns, so only once its metrics are here has the step run.
            metrics = to_floats(metrics)
            step, timing = state.progress.step, {"time/step": time.perf_counter() - started}
            fault_point("step", step, ctx.runtime.rank)
            if on_state is not None:
                timing["time/after_step"] = seconds_of(on_state, state)
            preempted = ctx.preempted()
            ctx.log(rows.row(state, metrics, timing))
            fault_point("row", step, ctx.runtime.rank)
            if preempted or should_checkpoint(
                step, ckpt.interval, config.max_steps, ckpt.save_final
            ):
                rows.saved(seconds_of(save_and_prune_, state))
            ctx.step_done(step)
            if preempted:
                raise ctx.stop_preempted(state)
            started = time.perf_counter()
        if ctx.runtime.is_main and rows.save_seconds:  # no row follows the last save
            print(f"saved step_{state.progress.step} in {rows.save_seconds:.2f} s", flush=True)
        ctx.finish(newest_checkpoint(state), best_text(config.output_dir, config.ckpt.keep_best))
        return state


def newest_checkpoint(state: TrainState) -> Optional[str]:
    """The name of the newest complete checkpoint of the run, if any."""
    steps = complete_steps(list_step_dirs(ckpt_root(state.config.output_dir)))
    return step_name(steps[-1]) if steps else None


def seconds_of(action: Callable[[TrainState], Any], state: TrainState) -> float:
    """Run `action(state)`; the seconds it took."""
    started = time.perf_counter()
    action(state)
    return time.perf_counter() - started


def save_and_prune_(state: TrainState) -> None:
    """Save `state`'s checkpoint, then (rank 0) apply ckpt.keep_last, keeping the best one
    (ckpt.keep_best; its row is already on disk)."""
    save_state_(state)
    if state.handles.runtime.is_main:
        ckpt = state.config.ckpt
        prune_checkpoints_(state.config.output_dir, ckpt.keep_last, ckpt.keep_best)
