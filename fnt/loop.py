"""The fold and the driver.

`fold` is pure control flow: it threads a TrainState through a source and a step function. `run`
is the one place with side effects: process group, the start state (fresh or restored: the resume
decision lives here), checkpoint saves, profiler window, monitors and signals.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from fnt.build import init_state, restore_
from fnt.checkpoint import (
    abandon_newer_,
    cleanup_checkpoints_,
    read_saved_config,
    save_checkpoint,
    should_checkpoint,
)
from fnt.config import Config, ConfigError, to_json, to_plain
from fnt.faults import fault_point
from fnt.metrics import (
    disk_metrics,
    flops_per_token,
    log_step_metrics,
    merge_metrics,
    peak_flops_per_device,
    peak_memory_gib,
    perf_metrics,
    to_floats,
)
from fnt.model import model_facts
from fnt.monitors import open_monitors
from fnt.profiler import save_trace, start_trace
from fnt.resume import (
    checkpoint_dir,
    complete_steps,
    list_checkpoints,
    override_lines,
    reconcile_config,
    refusal,
    resolve_resume_step,
    run_steps,
)
from fnt.setup import Runtime, setup_trainer, teardown_trainer
from fnt.sources import Source
from fnt.state import Progress, TrainState
from fnt.validation_pass import Validation

Metrics = dict[str, Any]
StepFn = Callable[[TrainState, Any], tuple[TrainState, Metrics]]
CONFIG_FILE = "config.json"
LOCK_FILE = "run.lock"


def fold(
    state: TrainState, source: Source, step_fn: StepFn, steps: int
) -> Iterator[tuple[TrainState, Metrics]]:
    """Run `steps` updates: each asks `source` for the batch of the current state, then steps.

    Yields every successor state with its metrics. The source sees only the current state, so it
    can never produce a batch ahead of the state it belongs to.
    """
    for _ in range(steps):
        state, metrics = step_fn(state, source(state))
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


def save_state(state: TrainState) -> Path:
    """Checkpoint `state` as checkpoints/step_{progress.step} of its output_dir (a collective
    under torchrun)."""
    runtime = state.handles.runtime
    return save_checkpoint(
        ckpt_root(state.config),
        state.progress,
        state.handles.model,
        state.handles.optimizer,
        model_name=state.config.model.name,
        rank=runtime.rank,
        distributed=runtime.distributed,
        config=state.config,
    )


def save_and_clean_(state: TrainState) -> float:
    """Save `state`'s checkpoint, then (rank 0) apply keep_last; returns the seconds it took."""
    started = time.perf_counter()
    save_state(state)
    if state.handles.runtime.is_main:
        cleanup_checkpoints_(ckpt_root(state.config), state.config.ckpt.keep_last)
    return time.perf_counter() - started


def start_state(config: Config, runtime: Runtime) -> TrainState:
    """The state a run starts from: restored from the checkpoint `config.resume` selects, or
    fresh, in which case an earlier run's checkpoints, rollouts and weights in the output
    directory are refused.

    Before anything is built, a resume reconciles the config with the checkpoint's
    (`reconcile_with_checkpoint`). Once the start state is loaded, rank 0 moves newer
    checkpoints and published weights, and unfinished saves of either, aside (`abandon_newer_`):
    the run forks there, and what it writes must not collide with, be deleted in favour of, or
    be mixed with the old trajectory's. It then runs the keep_last cleanup.
    """
    root = ckpt_root(config)
    resume_step = resolve_resume_step(config.resume, root)
    if resume_step is None:
        refuse_stale_checkpoints(root)
        refuse_stale_rl_files(Path(config.output_dir))
    else:
        reconcile_with_checkpoint(config, checkpoint_dir(root, resume_step), runtime.is_main)
    state = init_state(config, runtime)
    if resume_step is not None:
        state = restore_(state, checkpoint_dir(root, resume_step))
    if runtime.is_main:
        from fnt.rollout.external import WEIGHTS_DIR  # not at the top: it loads the RL stack

        for directory in (root, Path(config.output_dir) / WEIGHTS_DIR):
            for source, target in abandon_newer_(directory, state.progress.step):
                print(
                    f"starting at step {state.progress.step}: moved {source} to {target}",
                    flush=True,
                )
        # Also finishes a keep_last delete that a kill interrupted.
        cleanup_checkpoints_(root, config.ckpt.keep_last)
    return state


def reconcile_with_checkpoint(config: Config, checkpoint: Path, is_main: bool) -> None:
    """Compare `config` with the one `checkpoint` was written with (fnt.resume.RESUME_POLICY):
    a ConfigError listing every refused key, else (rank 0) one printed line per overridden key.
    """
    saved = read_saved_config(checkpoint)
    if saved is None:
        if is_main:
            print(
                f"resume: {checkpoint} records no config (an older fnt wrote it): "
                "the current config is used as it is",
                flush=True,
            )
        return
    decisions = reconcile_config(saved, to_plain(config), force=config.resume_force)
    message = refusal(decisions, checkpoint)
    if message is not None:
        raise ConfigError(message)
    if is_main:
        for line in override_lines(decisions):
            print(line, flush=True)


def refuse_stale_checkpoints(root: Path) -> None:
    """A fresh start must not mix with an earlier run's checkpoints in the same directory."""
    steps = complete_steps(list_checkpoints(root))
    if steps:
        raise ConfigError(
            f"{root} already holds checkpoints of an earlier run "
            f"(steps {', '.join(map(str, steps))}): "
            "pass --resume latest to continue it, or choose a new output_dir"
        )


def refuse_stale_rl_files(output_dir: Path) -> None:
    """A fresh start must not train on an earlier run's rollouts, nor publish its weights among
    that run's: refuse an output_dir whose rollouts/ or weights/ hold step directories."""
    from fnt.rollout.external import ROLLOUTS_DIR, WEIGHTS_DIR  # not at the top: see above

    found = {
        name: steps
        for name in (ROLLOUTS_DIR, WEIGHTS_DIR)
        if (steps := run_steps(list_checkpoints(output_dir / name)))
    }
    if found:
        listed = "; ".join(
            f"{output_dir / name} (steps {', '.join(map(str, steps))})"
            for name, steps in found.items()
        )
        raise ConfigError(
            f"a fresh start, but {listed} hold files of an earlier RL run, which this run would "
            "read as its own: remove or move them, or choose a new output_dir"
        )


def lock_output_dir_(output_dir: Path) -> IO[str]:
    """Take the run's exclusive lock on `output_dir`, or raise ConfigError naming its holder.

    Two runs on one directory would interleave their rows and checkpoints. The lock is an OS
    `flock`, so it is released when its holder dies, however it dies: a stale lock file never
    blocks. The holder's host and pid are written inside, for the message. Close the returned
    file to release it.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    # Opened without truncating: while another run holds the lock, its text must stay readable.
    lock = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a run that has not written its host and pid yet"
        lock.close()
        raise ConfigError(
            f"output_dir {str(output_dir)!r} is in use by another run ({holder}; lock {path}): "
            "wait for it to end, stop it, or choose another output_dir"
        ) from None
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    lock.flush()
    return lock


def exit_with_launcher_(poll_s: float = 0.5) -> None:
    """Under torchrun, end this worker when torchrun dies.

    torchrun stops its workers when it exits normally, but a torchrun killed with SIGKILL (or
    only its process group leader) leaves them running, still writing into a directory that a
    restarted job is using. A daemon thread watches the parent pid: when the worker is
    reparented, the launcher is gone, and the worker exits at once (status 1, one line on stderr).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        print(
            f"rank {os.environ.get('RANK', '?')}: the launcher (pid {launcher}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="fnt-launcher-watch", daemon=True).start()


# What schedulers send before they kill a job (SLURM: SIGTERM, or SIGUSR1 via --signal).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised by `run` after a preemption signal, once the step it stopped at is checkpointed.

    A SystemExit, so that the process exits with `runtime.preempt_exit_code` and no traceback,
    and so that no `except Exception` on the way up can swallow it.
    """


def agree_preempted(received: bool, runtime: Runtime) -> bool:
    """Whether any rank received a preemption signal; one all-reduce under torchrun, so that all
    ranks stop after the same step even when only some of them were signalled."""
    if not runtime.distributed:
        return received
    flag = torch.tensor([int(received)], dtype=torch.int32)  # CPU: gloo, also on CUDA
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run(
    config: Config,
    step_fn: StepFn,
    source: Source,
    *,
    on_state: Optional[Callable[[TrainState], Any]] = None,
) -> TrainState:
    """Train from the configured start (fresh or resumed) to `config.max_steps`; return the last
    state.

    `source(state)` gives the batch of the step after `state` (see fnt.sources). `on_state(state)`
    runs on every rank for the start state and after each update, before the checkpoint (e.g. to
    publish weights to an external rollout engine); its time is logged as time/after_step.

    Rank 0 holds the output directory's lock for the whole run (`lock_output_dir_`); under
    torchrun each worker exits when torchrun dies (`exit_with_launcher_`). After SIGTERM or
    SIGUSR1 the run checkpoints the step it is at and raises `Preempted`.
    """
    # A signal only takes note: the loop stops at the next step boundary, after a checkpoint, as
    # an exception raised mid-step or mid-save would lose the step or leave a partial save.
    signals: list[int] = []
    previous_handlers = {
        sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
        for sig in PREEMPT_SIGNALS
    }
    exit_with_launcher_()
    runtime = setup_trainer(config)
    lock = None
    monitors = None
    prof = None
    try:
        # Before anything in the directory is read or changed. The other ranks need no lock of
        # their own: if rank 0 fails here, torchrun stops them.
        if runtime.is_main:
            lock = lock_output_dir_(Path(config.output_dir))
        state = start_state(config, runtime)
        start_step = state.progress.step
        validation = Validation(state)  # with val.eval_on_start, evaluates the start state
        if on_state is not None:
            on_state(state)
        output_dir = Path(config.output_dir)
        if runtime.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / CONFIG_FILE).write_text(to_json(config) + "\n")
            monitors = open_monitors(config, start_step)
        peak_flops = peak_flops_per_device(config.runtime.peak_tflops, runtime.device)
        facts = model_facts(state.handles.model)
        fpt = flops_per_token(facts.num_params, facts.num_layers, facts.hidden_size, config.seq_len)

        prof = start_trace(config.trace_path)
        steps = max(0, config.max_steps - start_step)
        tokens_before = state.progress.total_tokens
        # The save after step N is timed in row N + 1, since row N is written before it.
        save_seconds = 0.0
        preempted = False
        step_started = time.perf_counter()
        for state, metrics in fold(state, source, step_fn, steps):
            step = state.progress.step
            fault_point("step", step, runtime.rank)
            step_seconds = time.perf_counter() - step_started
            timing = {"time/step": step_seconds}
            if on_state is not None:
                hook_started = time.perf_counter()
                on_state(state)
                timing["time/after_step"] = time.perf_counter() - hook_started
            preempted = agree_preempted(bool(signals), runtime)
            tokens = state.progress.total_tokens - tokens_before
            tokens_before = state.progress.total_tokens
            # Row N is on disk before step_N is committed: a kill in between resumes from an
            # earlier checkpoint and rewrites the row, never from step_N with row N missing.
            val_metrics = validation.row_metrics(state)  # evaluates when the step is due
            log_step_metrics(
                step,
                merge_metrics(to_floats(metrics), progress_metrics(state.progress), val_metrics),
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
            fault_point("row", step, runtime.rank)
            save_seconds = 0.0
            if preempted or should_checkpoint(
                step, config.ckpt.interval, config.max_steps, config.ckpt.save_final
            ):
                save_seconds = save_and_clean_(state)
            if prof is not None and config.trace_steps and step - start_step >= config.trace_steps:
                save_trace(prof, config.trace_path, runtime.rank)
                prof = None
            if preempted:
                break
            step_started = time.perf_counter()
        if runtime.is_main and save_seconds:
            # No row follows the last save to carry its time.
            print(f"saved step_{state.progress.step} in {save_seconds:.2f} s", flush=True)
        if preempted:
            code = config.runtime.preempt_exit_code
            if runtime.is_main:
                by = signal.Signals(signals[0]).name if signals else "a signal to another rank"
                print(
                    f"preempted by {by}: stopped after checkpointing step {state.progress.step}, "
                    f"exit status {code}",
                    flush=True,
                )
            raise Preempted(code)
        return state
    finally:
        if prof is not None:
            save_trace(prof, config.trace_path, runtime.rank)
        if monitors is not None:
            monitors.close()
        teardown_trainer(runtime)
        if lock is not None:
            lock.close()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
