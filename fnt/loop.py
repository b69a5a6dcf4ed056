"""The fold and the driver.

`fold` is pure control flow: it threads a TrainState through a step function. `run` is the one
place with side effects: process group, model and optimizer construction, checkpoint load and
save, profiler window, monitors and signals.
"""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from fnt.checkpoint import (
    cleanup_checkpoints_,
    load_checkpoint_,
    save_checkpoint,
    should_checkpoint,
)
from fnt.config import Config, ConfigError, to_json
from fnt.metrics import (
    disk_metrics,
    flops_per_token,
    log_step_metrics,
    peak_flops_per_device,
    peak_memory_gib,
    perf_metrics,
    to_floats,
)
from fnt.model import load_model
from fnt.monitors import open_monitors
from fnt.optim import setup_optimizer
from fnt.optim.setup import apply_compute_dtype_
from fnt.profiler import save_trace, start_trace
from fnt.resume import checkpoint_dir, complete_steps, list_checkpoints, resolve_resume_step
from fnt.setup import Runtime, setup_trainer, teardown_trainer
from fnt.state import Handles, Progress, StepCursor, TrainState

Metrics = dict[str, Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, Metrics]]
CONFIG_FILE = "config.json"


def fold(
    state: TrainState, batches: Iterable[Any], step_fn: StepFn
) -> Iterator[tuple[TrainState, Metrics]]:
    """Thread `state` through `step_fn` for each batch, yielding every successor and its metrics."""
    for batch in batches:
        state, metrics = step_fn(state, batch)
        yield state, metrics


def progress_metrics(progress: Progress) -> dict[str, float]:
    """progress/* keys of a row, derived from Progress. Pure."""
    return {
        "progress/epoch": float(progress.data.epoch),
        "progress/num_samples": float(progress.total_samples),
        "progress/num_tokens": float(progress.total_tokens),
    }


def ckpt_root(config: Config) -> Path:
    return Path(config.output_dir) / "checkpoints"


def build_state(
    config: Config, runtime: Runtime, extra: Optional[dict] = None
) -> tuple[TrainState, Any]:
    """Model, optimizer and Progress, restored from a checkpoint when `config.resume` says so."""
    plan = runtime.offload
    model, facts = load_model(config.model, runtime, plan)
    optimizer = setup_optimizer(config.optim, model, runtime.dims, config.model)
    resume_step = resolve_resume_step(config.resume, ckpt_root(config))
    if resume_step is None:
        refuse_stale_checkpoints(ckpt_root(config))
    progress = Progress()
    if resume_step is not None:
        progress = load_checkpoint_(
            checkpoint_dir(ckpt_root(config), resume_step),
            model,
            optimizer,
            distributed=runtime.distributed,
        )
    apply_compute_dtype_(model, optimizer, plan)
    handles = Handles(model, optimizer, runtime, StepCursor(progress.step), extra)
    return TrainState(config, progress, handles), facts


def refuse_stale_checkpoints(root: Path) -> None:
    """A fresh start must not mix with an earlier run's checkpoints in the same directory."""
    steps = complete_steps(list_checkpoints(root))
    if steps:
        raise ConfigError(
            f"{root} already holds checkpoints of an earlier run "
            f"(steps {', '.join(map(str, steps))}): "
            "pass --resume latest to continue it, or choose a new output_dir"
        )


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated(f"received signal {signum}")


def run(
    config: Config,
    step_fn: StepFn,
    make_batches: Callable[[TrainState], Iterable[Any]],
    *,
    extra: Optional[Callable[[Config, Runtime], dict]] = None,
    after_step: Optional[Callable[[TrainState], Any]] = None,
    console: bool = True,
) -> TrainState:
    """Train from the configured start (fresh or resumed) to `config.max_steps`.

    `make_batches(state)` must yield the batches for steps state.progress.step + 1, + 2, ...
    `extra(config, runtime)` may add step-specific handles (e.g. a rollout engine).
    `after_step(state)` runs on every rank after each update, before the checkpoint (e.g. to
    publish weights to an external rollout engine); its time is logged as time/after_step.
    """
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    runtime = setup_trainer(config)
    monitors = None
    prof = None
    try:
        state, facts = build_state(config, runtime, extra(config, runtime) if extra else None)
        start_step = state.progress.step
        output_dir = Path(config.output_dir)
        if runtime.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / CONFIG_FILE).write_text(to_json(config) + "\n")
            monitors = open_monitors(config, start_step, console=console)
        peak_flops = peak_flops_per_device(config.runtime.peak_tflops, runtime.device)
        fpt = flops_per_token(facts.num_params, facts.num_layers, facts.hidden_size, config.seq_len)

        prof = start_trace(config.trace_path)
        batches = itertools.islice(make_batches(state), max(0, config.max_steps - start_step))
        tokens_before = state.progress.total_tokens
        step_started = time.perf_counter()
        for state, metrics in fold(state, batches, step_fn):
            step = state.progress.step
            step_seconds = time.perf_counter() - step_started
            timing = {"time/step": step_seconds}
            if after_step is not None:
                hook_started = time.perf_counter()
                after_step(state)
                timing["time/after_step"] = time.perf_counter() - hook_started
            save_seconds = 0.0
            if should_checkpoint(
                step, config.ckpt.interval, config.max_steps, config.ckpt.save_final
            ):
                save_started = time.perf_counter()
                save_checkpoint(
                    ckpt_root(config),
                    state.progress,
                    state.handles.model,
                    state.handles.optimizer,
                    model_name=config.model.name,
                    rank=runtime.rank,
                    distributed=runtime.distributed,
                )
                if runtime.is_main:
                    cleanup_checkpoints_(ckpt_root(config), config.ckpt.keep_last)
                save_seconds = time.perf_counter() - save_started
            tokens = state.progress.total_tokens - tokens_before
            tokens_before = state.progress.total_tokens
            log_step_metrics(
                step,
                {**to_floats(metrics), **progress_metrics(state.progress)},
                time=time.time(),
                perf=perf_metrics(
                    tokens,
                    step_seconds,
                    runtime.world_size,
                    fpt,
                    peak_flops,
                    peak_memory_gib(runtime.device),
                ),
                timing={**timing, "time/save_ckpt": save_seconds},
                disk=disk_metrics(ckpt_root(config)),
                monitor=monitors,
                is_main=runtime.is_main,
            )
            if prof is not None and config.trace_steps and step - start_step >= config.trace_steps:
                save_trace(prof, config.trace_path, runtime.rank)
                prof = None
            step_started = time.perf_counter()
        return state
    finally:
        if prof is not None:
            save_trace(prof, config.trace_path, runtime.rank)
        if monitors is not None:
            monitors.close()
        teardown_trainer(runtime)
        signal.signal(signal.SIGTERM, previous_handler)
