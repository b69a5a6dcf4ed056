"""Where metric rows go: metrics.jsonl, Weights & Biases, the console. Side effects: files, W&B.

`Monitors.log(row)` is the one call per step. Only rank 0 creates monitors. A W&B failure is a
warning, never a crash, and never costs the metrics.jsonl row (that row is written first).
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping

from fnt.config import Config, to_plain
from fnt.faults import fault_point
from fnt.metrics import finite_or_none
from fnt.rundir import METRICS_FILE, WANDB_ID_FILE
from fnt.transaction import fsync_dir, write_synced_


def strict_json_line(row: Mapping[str, Any]) -> str:
    """One JSON object on one line with NaN/inf as null, so every line parses strictly. Pure."""
    clean = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


def rows_through(lines: list[str], last_step: int) -> list[str]:
    """The lines whose row has step <= last_step; a torn last line of a crash is dropped. Pure."""
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def truncate_metrics_(path: Path, last_step: int) -> None:
    """Drop rows beyond `last_step` (left by a crashed run) so each step keeps exactly one row.

    A transaction: the kept rows go to a temporary file, fsynced, renamed over the file, and the
    directory is fsynced, so a crash or power loss leaves the old file or the trimmed one, never
    a truncated one (rows 1..N must survive as long as step_N does).
    """
    if not path.exists():
        return
    kept = rows_through(path.read_text().splitlines(keepends=True), last_step)
    tmp = path.with_suffix(".jsonl.tmp")
    write_synced_(tmp, "".join(kept))
    os.replace(tmp, path)
    fsync_dir(path.parent)


class JsonlMonitor:
    """Appends one strict-JSON line per step to metrics.jsonl, flushed and fsynced every step.

    The fsync keeps "row N before checkpoint step_N" true through a power loss too: the
    checkpoint's commit is fsynced, so the row before it must be as well.
    """

    def __init__(self, path: Path, start_step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics_(path, start_step)
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def log(self, row: Mapping[str, Any]) -> None:
        self._fh.write(strict_json_line(row) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


# How many rows may wait for W&B. A healthy W&B takes milliseconds per row, so a full queue means
# it has stopped keeping up; it is disabled rather than left to grow without bound.
WANDB_QUEUE_ROWS = 1000


def wandb_init_attempts(saved_run_id: str | None, start_step: int, new_run_id: str) -> list[dict]:
    """The `wandb.init` arguments to try in order, so that the W&B run holds the same rows as
    metrics.jsonl. Pure.

    A fresh run (start_step 0, or no recorded id) starts the run `new_run_id`. A run resumed at
    step N first rewinds the recorded run to N (`resume_from`: history after N is dropped, the id
    stays), else forks a new run from it at N (`fork_from`: the new run shares history up to N),
    else starts a new run whose config names the old run and step. Both rewind and fork need
    server support, so each can fail; the W&B step of a row is its step.
    """
    if start_step == 0 or saved_run_id is None:
        return [{"id": new_run_id}]
    point = f"{saved_run_id}?_step={start_step}"
    return [
        {"resume_from": point},
        {"id": new_run_id, "fork_from": point},
        {"id": new_run_id, "resumed_from": point},
    ]


class WandbMonitor:
    """Weights & Biases logging on a thread of its own, so that W&B never holds up training.

    `log` only puts the row in a bounded queue; a worker thread makes the W&B calls (init, log,
    finish) in order. W&B is disabled for the rest of the run, with one warning, when a call
    fails, when a call has not returned after `wandb.timeout_s` seconds, or when the queue is
    full; metrics.jsonl is unaffected. `close` waits at most `wandb.timeout_s` for the queued rows
    and `finish`. The worker is a daemon thread: one stuck inside W&B does not keep the process
    alive.
    """

    def __init__(self, config: Config, start_step: int) -> None:
        self.run = None  # the W&B run, once the worker has created it
        self.timeout_s = config.wandb.timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=WANDB_QUEUE_ROWS)
        self._lock = threading.Lock()
        self._disabled = False
        self._call_started: float | None = None  # when the worker's current W&B call began
        self._current_call = ""
        output_dir = Path(config.output_dir)
        attempts = wandb_init_attempts(
            recorded_wandb_run_id(output_dir), start_step, uuid.uuid4().hex[:12]
        )
        self._thread = threading.Thread(
            target=self._work, args=(config, output_dir, attempts), name="fnt-wandb", daemon=True
        )
        self._thread.start()

    @property
    def disabled(self) -> bool:
        return self._disabled

    def log(self, row: Mapping[str, Any]) -> None:
        if self._disabled or self._stalled():
            return
        try:
            self._queue.put_nowait(dict(row))
        except queue.Full:
            self._disable(
                f"W&B has fallen {WANDB_QUEUE_ROWS} rows behind at step {row['step']}, "
                "disabling W&B (metrics.jsonl has every row)"
            )

    def close(self) -> None:
        if self._disabled or self._stalled():
            return
        try:
            self._queue.put_nowait(None)  # the worker finishes the run and ends
        except queue.Full:
            self._disable("W&B is too far behind to finish, disabling W&B")
            return
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            self._disable(
                f"W&B did not log its last rows and finish within wandb.timeout_s = "
                f"{self.timeout_s:g} s; giving up on it (metrics.jsonl has every row)"
            )

    def _stalled(self) -> bool:
        started = self._call_started
        if started is None or time.monotonic() - started <= self.timeout_s:
            return False
        self._disable(
            f"W&B {self._current_call} has not returned after wandb.timeout_s = "
            f"{self.timeout_s:g} s, disabling W&B (metrics.jsonl has every row)"
        )
        return True

    def _disable(self, message: str) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = True
        warnings.warn(message, stacklevel=3)

    def _call(self, what: str, fn, *args, **kwargs):
        self._current_call = what
        self._call_started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._call_started = None

    def _work(self, config: Config, output_dir: Path, attempts: list[dict]) -> None:
        if not self._init(config, output_dir, attempts):
            return
        while True:
            row = self._queue.get()
            if self._disabled:
                return
            if row is None:
                try:
                    self._call("finish", self.run.finish)
                except Exception as exc:  # noqa: BLE001 - W&B must never stop training
                    self._disable(f"W&B finish failed: {exc}")
                return
            try:
                values = {k: v for k, v in row.items() if k != "step"}
                fault_point("wandb", row["step"])
                self._call(f"log of step {row['step']}", self.run.log, values, step=row["step"])
            except Exception as exc:  # noqa: BLE001 - W&B must never stop training
                self._disable(f"W&B log failed at step {row['step']}, disabling W&B: {exc}")
                return

    def _init(self, config: Config, output_dir: Path, attempts: list[dict]) -> bool:
        try:
            import wandb
        except Exception as exc:  # noqa: BLE001
            self._disable(f"W&B init failed, continuing without it: {exc}")
            return False
        failures = []
        for attempt in attempts:
            kwargs = dict(attempt)
            try:
                run_config = to_plain(config)
                if "resumed_from" in kwargs:
                    run_config["fnt_resumed_from"] = kwargs.pop("resumed_from")
                self.run = self._call(
                    "init",
                    wandb.init,
                    project=config.wandb.project,
                    name=config.wandb.name or None,
                    mode=config.wandb.mode,
                    dir=config.output_dir,
                    config=run_config,
                    **kwargs,
                )
            except Exception as exc:  # noqa: BLE001 - try the next way, then give up
                failures.append(f"{_init_kind(attempt)}: {exc}")
                continue
            record_wandb_run_id_(output_dir, self.run.id)
            if failures:
                print(f"W&B: {_init_kind(attempt)} after {'; '.join(failures)}", flush=True)
            return not self._disabled
        self._disable(f"W&B init failed, continuing without it: {'; '.join(failures)}")
        return False


def _init_kind(attempt: Mapping[str, Any]) -> str:
    if "resume_from" in attempt:
        return f"rewind of {attempt['resume_from']}"
    if "fork_from" in attempt:
        return f"fork of {attempt['fork_from']}"
    if "resumed_from" in attempt:
        return f"new run {attempt['id']} linked to {attempt['resumed_from']} in its config"
    return f"new run {attempt['id']}"


def recorded_wandb_run_id(output_dir: Path) -> str | None:
    """The W&B run id recorded in the run directory, if any."""
    path = output_dir / WANDB_ID_FILE
    return path.read_text().strip() or None if path.exists() else None


def record_wandb_run_id_(output_dir: Path, run_id: str) -> None:
    """Record the W&B run this run directory logs to (a resume rewinds or forks it)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_synced_(output_dir / WANDB_ID_FILE, run_id + "\n")


def format_duration(seconds: float) -> str:
    """`H:MM:SS` with as many hours as needed (no wrap at a day). Pure."""
    total = int(round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def console_line(row: Mapping[str, Any], max_steps: int, elapsed: float, steps_done: int) -> str:
    """`step 3/5 | loss 2.1 | lr 1e-03 | 512 tok/s | 0.25 s/step | eta 0:00:01`. Pure."""
    step = row["step"]
    parts = [f"step {step}/{max_steps}"]
    loss = row.get("loss/mean")
    if isinstance(loss, float):
        parts.append(f"loss {loss:.4f}" if math.isfinite(loss) else f"loss {loss}")
    if "optim/lr" in row:
        parts.append(f"lr {row['optim/lr']:.2e}")
    if "perf/throughput" in row:
        parts.append(f"{row['perf/throughput']:.0f} tok/s")
    if "time/step" in row:
        parts.append(f"{row['time/step']:.2f} s/step")
    remaining = max(0, max_steps - step)
    eta = elapsed / steps_done * remaining if steps_done else 0.0
    parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)


class ConsoleMonitor:
    """One line per step on stdout."""

    def __init__(self, max_steps: int, start_step: int) -> None:
        self.max_steps = max_steps
        self.start_step = start_step
        self.started = time.perf_counter()

    def log(self, row: Mapping[str, Any]) -> None:
        elapsed = time.perf_counter() - self.started
        line = console_line(row, self.max_steps, elapsed, row["step"] - self.start_step)
        print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        pass


class Monitors:
    """All monitors behind one `log(row)` call; metrics.jsonl is always written first."""

    def __init__(self, monitors: list[Any]) -> None:
        self.monitors = monitors

    def log(self, row: Mapping[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.log(row)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


def open_monitors(config: Config, start_step: int) -> Monitors:
    """metrics.jsonl (trimmed to `start_step`), W&B unless disabled, and the console line."""
    monitors: list[Any] = [JsonlMonitor(Path(config.output_dir) / METRICS_FILE, start_step)]
    if config.wandb.mode != "disabled":
        monitors.append(WandbMonitor(config, start_step))
    monitors.append(ConsoleMonitor(config.max_steps, start_step))
    return Monitors(monitors)
