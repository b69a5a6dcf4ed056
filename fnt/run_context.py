"""What a run holds around its loop, as one context manager (`RunContext`). Side effects: signal
handlers, a launcher watchdog thread, the process group, the run lock, config.json, the
monitors, the profiler, closing the sources' handles, and an all-reduce per step for
preemption.

Entering takes, in order: the preemption signals (SIGTERM, SIGUSR1: the first asks for a
checkpoint at the next step boundary, within a grace period: PreemptionWatch, with a thread of
its own), the watchdog that ends a torchrun worker whose launcher died, the run lock (rank 0,
before anything in the directory is read or changed; the command line takes it earlier still,
and then it is already held: fnt.store.rundir.run_lock nests), and the process group
(fnt.distributed.runtime.setup_trainer). A failure before the first row is written leaves the
output directory as the lock found it (fnt.store.failed_start; `log` marks the first row).
`begin_(state)` then acts on the start state: its handles are closed at the end, config.json is
written and the monitors opened (rank 0), and the profiler starts. Leaving undoes everything in
the reverse order, on a normal exit, an error or a preemption alike.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Mapping, Optional

from fnt.config import Config, to_json
from fnt.distributed.collectives import all_reduce_max
from fnt.distributed.runtime import Runtime, setup_trainer, teardown_trainer
from fnt.obs.console import end_summary
from fnt.obs.monitors import open_monitors
from fnt.obs.profiler import save_trace_, start_trace
from fnt.state import TrainState
from fnt.store.rundir import CONFIG_FILE, make_output_dir_, rank0_run_lock, start_done

# What schedulers send before they kill a job (SLURM: SIGTERM, or SIGUSR1 via --signal).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised by `run` after a preemption signal, once the step it stopped at is checkpointed.

    A SystemExit, so that the process exits with `runtime.preempt_exit_code` and no traceback,
    and so that no `except Exception` on the way up can swallow it.
    """


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


class PreemptionWatch:
    """SIGTERM and SIGUSR1 as a scheduler sends them: the first asks for a checkpoint at the next
    step boundary (the loop reads `received`), and the run gets `grace_s` seconds to reach it;
    if it does not (a step hung in a reward function, a collective or I/O), or on a second
    signal, the process exits at once with `exit_code`, after one line naming what it was
    doing. Exiting then writes nothing half-done: a row is one appended line, a checkpoint a
    transaction, so the previous checkpoint stays the resume point.

    A Python signal handler runs only when the main thread is between bytecodes, which a hung
    C call never is; so the handlers do nothing and a thread of its own learns of each signal
    through `signal.set_wakeup_fd`, to which the interpreter writes the signal's number from
    the C handler, at once.
    """

    def __init__(self, grace_s: float, exit_code: int) -> None:
        self.grace_s = grace_s
        self.exit_code = exit_code
        self.received: list[int] = []
        self.doing = "the start"  # what the run is doing, for the exit line
        self._deadline: Optional[float] = None  # armed by the first signal, until the boundary
        self._lock = threading.Lock()

    def __enter__(self) -> PreemptionWatch:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {sig: signal.signal(sig, _note_nothing) for sig in PREEMPT_SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="fnt-preemption", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the watcher reads end-of-file and ends
        self._thread.join()
        os.close(self._read_fd)

    def reached_boundary(self) -> None:
        """The step ended and its checkpoint begins: no deadline any more (a second signal still
        ends the run)."""
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            with self._lock:
                deadline = self._deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if not ready:
                with self._lock:
                    expired = self._deadline is not None and time.monotonic() >= self._deadline
                if expired:
                    self._exit(
                        f"{self.doing} did not end within runtime.preempt_grace_s = "
                        f"{self.grace_s:g} s"
                    )
                continue
            data = os.read(self._read_fd, 64)
            if not data:
                return
            for signum in data:
                if signum not in PREEMPT_SIGNALS:
                    continue
                if self.received:
                    self._exit(f"a second {signal.Signals(signum).name} during {self.doing}")
                self.received.append(signum)
                with self._lock:
                    self._deadline = time.monotonic() + self.grace_s

    def _exit(self, why: str) -> None:
        first = signal.Signals(self.received[0]).name
        print(
            f"preempted by {first}: {why}; exiting with status {self.exit_code} without "
            "checkpointing it (the newest complete checkpoint stays the resume point)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(self.exit_code)


def _note_nothing(signum: int, frame: object) -> None:
    """The preemption signals' Python handler: the watcher thread has already been told."""


def agree_preempted(received: bool, runtime: Runtime) -> bool:
    """Whether any rank received a preemption signal; one all-reduce under torchrun, so that all
    ranks stop after the same step even when only some of them were signalled."""
    return bool(all_reduce_max([float(received)], runtime)[0])


class RunContext:
    """The side effects around a run's loop (see the module docstring): `with RunContext(config)
    as ctx`, then `ctx.begin_(state)` with the start state, `ctx.log(row)` once per step,
    `ctx.preempted()` at each step boundary and `ctx.step_done(step)` after each step."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.watch = PreemptionWatch(
            config.runtime.preempt_grace_s, config.runtime.preempt_exit_code
        )
        self.signals = self.watch.received
        self.stack = contextlib.ExitStack()
        self.monitors: Any = None
        self.profiler: Any = None
        self.start_step = 0
        self.first_row: Optional[Mapping[str, Any]] = None  # for the end summary
        self.last_row: Optional[Mapping[str, Any]] = None
        self.started = time.perf_counter()

    def __enter__(self) -> RunContext:
        stack, config = self.stack, self.config
        try:
            stack.enter_context(self.watch)
            exit_with_launcher_()
            stack.enter_context(rank0_run_lock(config.output_dir))
            self.runtime = setup_trainer(config)
            stack.callback(teardown_trainer, self.runtime)
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> Optional[bool]:
        return self.stack.__exit__(*exc)

    def begin_(self, state: TrainState) -> None:
        """Begin the run at its start state: close its handles when the run ends, write
        config.json and open the monitors (rank 0), start the profiler. The state's config is
        the run's from here on (it has max_epochs resolved to max_steps)."""
        self.config = state.config
        config, runtime = self.config, self.runtime
        self.start_step = state.progress.step
        self.watch.doing = f"step {self.start_step + 1}"
        for component in state.handles.components().values():
            self.stack.callback(component.close)
        if runtime.is_main:
            output_dir = make_output_dir_(config.output_dir)
            (output_dir / CONFIG_FILE).write_text(to_json(config) + "\n")
            self.monitors = open_monitors(config, self.start_step)
            self.stack.callback(self.monitors.close)
        self.profiler = start_trace(config.trace_path)
        self.stack.callback(self._stop_profiler)

    def log(self, row: Mapping[str, Any]) -> None:
        """Write a step's row to every monitor (rank 0; metrics.jsonl first)."""
        if self.monitors is not None:
            self.monitors.log(row)
            if self.first_row is None:  # the run has begun: a failure now is not its start's
                start_done(self.config.output_dir)
            self.first_row = self.first_row or row
            self.last_row = row

    def finish(self, checkpoint: Optional[str], best: Optional[str] = None) -> None:
        """Print the end summary (rank 0): the steps run, how the loss (and reward) went, the
        newest checkpoint and the best one (ckpt.keep_best)."""
        if self.runtime.is_main:
            seconds = time.perf_counter() - self.started
            print(end_summary(self.first_row, self.last_row, seconds, checkpoint, best), flush=True)

    def preempted(self) -> bool:
        """Whether any rank has received a preemption signal (all ranks agree); the step has
        then reached its boundary, and the grace period ends."""
        if not agree_preempted(bool(self.signals), self.runtime):
            return False
        self.watch.reached_boundary()
        self.watch.doing = f"the checkpoint after {self.watch.doing}"
        return True

    def step_done(self, step: int) -> None:
        """Note that step `step` is over; close the profiler window once trace_steps steps have
        run (0: it stays open)."""
        self.watch.doing = f"step {step + 1}"
        trace_steps = self.config.trace_steps
        if self.profiler is not None and trace_steps and step - self.start_step >= trace_steps:
            self._stop_profiler()

    def stop_preempted(self, state: TrainState) -> Preempted:
        """The exception that ends a preempted run (its step is checkpointed), announced."""
        code = self.config.runtime.preempt_exit_code
        if self.runtime.is_main:
            by = (
                signal.Signals(self.signals[0]).name if self.signals else "a signal to another rank"
            )
            print(
                f"preempted by {by}: stopped after checkpointing step {state.progress.step}, "
                f"exit status {code}",
                flush=True,
            )
        return Preempted(code)

    def _stop_profiler(self) -> None:
        if self.profiler is not None:
            save_trace_(self.profiler, self.config.trace_path, self.runtime.rank)
            self.profiler = None
