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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Optional

from fnt.config import Config, to_plain
from fnt.faults import fault_point
from fnt.obs.metrics import finite_or_none
from fnt.store.jsonl import json_problem
from fnt.store.rundir import (
    METRICS_FILE,
    METRICS_MISSING_FILE,
    WANDB_ID_FILE,
    WANDB_LOGGED_FILE,
    read_missing_steps,
    step_ranges,
)
from fnt.store.transaction import fsync_dir, write_synced_


def strict_json_line(row: Mapping[str, Any]) -> str:
    """One JSON object on one line with NaN/inf as null, so every line parses strictly. Pure."""
    clean = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


@dataclass(frozen=True)
class MetricsRepair:
    """What a resume found in metrics.jsonl up to the step it starts from (`repair_rows`)."""

    kept: dict[int, str]  # step -> its row's line (with the newline), steps 1..last_step
    unreadable: dict[int, str]  # line number -> why that line is not a row
    duplicated: dict[int, list[int]]  # step -> the line numbers of its rows (the last is kept)
    beyond: list[int]  # steps after last_step, whose rows are dropped (the run redoes them)
    missing: list[int]  # steps 1..last_step without a readable row

    def messages(self, name: str, missing_file: str, known_missing: Collection[int]) -> list[str]:
        """One line per finding; missing steps already in `known_missing` are not repeated."""
        lines = [
            f"{name}:{n}: not a metrics row ({why}); dropped" for n, why in self.unreadable.items()
        ]
        lines += [
            f"{name}: step {step} has {len(numbers)} rows (lines "
            f"{', '.join(map(str, numbers))}); kept the last"
            for step, numbers in self.duplicated.items()
        ]
        if self.beyond:
            lines.append(
                f"{name}: dropped the rows of steps {step_ranges(self.beyond)}, after the step "
                "this run starts from (it redoes them)"
            )
        new_missing = [step for step in self.missing if step not in set(known_missing)]
        if new_missing:
            lines.append(
                f"{name}: steps {step_ranges(new_missing)} have no readable row; recorded as "
                f"missing in {missing_file}"
            )
        return lines


def repair_rows(lines: list[str], last_step: int) -> MetricsRepair:
    """One row per step 1..last_step from the lines of a metrics.jsonl, and what was wrong. Pure.

    A line that is not a strict-JSON object with an integer step >= 1 is unreadable (a crash
    leaves its last line torn; anything else is damage); of several rows of one step the last
    is kept, since a later row was written by the trajectory that went on from there.
    """
    kept: dict[int, str] = {}
    numbers: dict[int, list[int]] = {}
    unreadable: dict[int, str] = {}
    beyond: set[int] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row, why = parse_row(line)
        if row is None:
            unreadable[number] = why
        elif row["step"] > last_step:
            beyond.add(row["step"])
        else:
            kept[row["step"]] = line if line.endswith("\n") else line + "\n"
            numbers.setdefault(row["step"], []).append(number)
    return MetricsRepair(
        kept=dict(sorted(kept.items())),
        unreadable=unreadable,
        duplicated={step: ns for step, ns in sorted(numbers.items()) if len(ns) > 1},
        beyond=sorted(beyond),
        missing=[step for step in range(1, last_step + 1) if step not in kept],
    )


def parse_row(line: str) -> tuple[Optional[dict], str]:
    """`(row, "")` for a metrics row, else `(None, why not)`. Pure."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, json_problem(exc)
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        return None, "not an object with an integer step >= 1"
    return row, ""


def repair_metrics_(path: Path, last_step: int) -> list[str]:
    """Rewrite metrics.jsonl to one row per step 1..last_step (`repair_rows`): rows beyond
    `last_step` (left by a crashed run, which this run redoes), unreadable lines and all but the
    last row of a step are dropped, each with a line in the returned messages; steps without a
    row are recorded in metrics_missing.json beside it. Never silent: every dropped line is
    named by a message.

    A transaction: the kept rows go to a temporary file, fsynced, renamed over the file, and the
    directory is fsynced, so a crash or power loss leaves the old file or the repaired one,
    never a truncated one (rows 1..N must survive as long as step_N does).
    """
    missing_file = path.with_name(METRICS_MISSING_FILE)
    known = read_missing_steps(missing_file)
    lines = (
        path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if path.exists()
        else []
    )
    repair = repair_rows(lines, last_step)
    if path.exists():
        tmp = path.with_suffix(".jsonl.tmp")
        write_synced_(tmp, "".join(repair.kept.values()))
        os.replace(tmp, path)
    if repair.missing:
        write_synced_(missing_file, json.dumps({"missing_steps": repair.missing}) + "\n")
    else:
        missing_file.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return repair.messages(str(path), missing_file.name, known)


class JsonlMonitor:
    """Appends one strict-JSON line per step to metrics.jsonl, flushed and fsynced every step.

    The fsync keeps "row N before checkpoint step_N" true through a power loss too: the
    checkpoint's commit is fsynced, so the row before it must be as well.
    """

    def __init__(self, path: Path, start_step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        for message in repair_metrics_(path, start_step):
            print(message, flush=True)
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


def replay_steps(attempt: Mapping[str, Any], logged: Optional[dict], start_step: int) -> range:
    """The steps of metrics.jsonl to send again after `wandb.init(**attempt)` succeeded, before
    the rows of the steps after `start_step`: those the W&B run does not hold. Pure.

    A rewind or fork at step N holds what the old run had received up to N, which is less when
    W&B was behind when the run died (`logged`: the last step W&B took, recorded by the worker);
    a new run (W&B turned on at a resume, or linked to the old run) holds nothing.
    """
    point = attempt.get("resume_from") or attempt.get("fork_from")
    if point is None:
        return range(1, start_step + 1)
    run_id = point.split("?_step=")[0]
    received = logged["step"] if logged and logged.get("run_id") == run_id else 0
    return range(min(received, start_step) + 1, start_step + 1)


class WandbMonitor:
    """Weights & Biases logging on a thread of its own, so that W&B never holds up training.

    `log` only puts the row in a bounded queue; a worker thread makes the W&B calls (init, log,
    finish) in order. W&B is disabled for the rest of the run, with one warning, when a call
    fails, when a call has not returned after `wandb.timeout_s` seconds, or when the queue is
    full; metrics.jsonl is unaffected. `close` waits at most `wandb.timeout_s` for the queued
    rows, then at most `wandb.finish_timeout_s` for `finish`. The worker is a daemon thread: one
    stuck inside W&B does not keep the process alive.

    After each row W&B takes, the worker records its step (`wandb_logged`), so that a resumed
    run knows how far W&B had got: it first sends again, in step order, the rows of
    metrics.jsonl that the rewound or forked W&B run lacks (`replay_steps`), and the W&B run
    ends up holding the rows of metrics.jsonl.
    """

    def __init__(self, config: Config, start_step: int) -> None:
        self.run = None  # the W&B run, once the worker has created it
        self.timeout_s = config.wandb.timeout_s
        self.finish_timeout_s = config.wandb.finish_timeout_s
        self.start_step = start_step
        self._queue: queue.Queue = queue.Queue(maxsize=WANDB_QUEUE_ROWS)
        self._lock = threading.Lock()
        self._disabled = False
        self._call_started: float | None = None  # when the worker's current W&B call began
        self._current_call = ""
        output_dir = Path(config.output_dir)
        attempts = wandb_init_attempts(
            recorded_wandb_run_id(output_dir), start_step, uuid.uuid4().hex[:12]
        )
        self._logged = read_wandb_logged(output_dir)
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
        rows_deadline = time.monotonic() + self.timeout_s
        while self._thread.is_alive():
            self._thread.join(0.05)
            if self._current_call == "finish":
                break
            if time.monotonic() > rows_deadline or self._stalled():
                self._disable(
                    f"W&B did not take its last rows within wandb.timeout_s = "
                    f"{self.timeout_s:g} s; giving up on it (metrics.jsonl has every row, and "
                    "a resume sends W&B what it lacks)"
                )
                return
        self._thread.join(self.finish_timeout_s)
        if self._thread.is_alive():
            self._disable(
                f"W&B did not finish within wandb.finish_timeout_s = {self.finish_timeout_s:g} "
                "s; giving up on it (metrics.jsonl has every row)"
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
        attempt = self._init(config, output_dir, attempts)
        if attempt is None:
            return
        steps = replay_steps(attempt, self._logged, self.start_step)
        if steps:
            replayed = 0
            for row in read_rows(output_dir / METRICS_FILE, steps):
                if self._disabled or not self._send(row, output_dir):
                    return
                replayed += 1
            print(
                f"W&B: sent again the {replayed} rows it lacked (steps {steps.start}.."
                f"{steps.stop - 1} of {METRICS_FILE})",
                flush=True,
            )
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
            if not self._send(row, output_dir):
                return

    def _send(self, row: Mapping[str, Any], output_dir: Path) -> bool:
        """Log one row; record its step as taken. False (W&B disabled) when the call fails."""
        try:
            values = {k: v for k, v in row.items() if k != "step"}
            fault_point("wandb", row["step"])
            self._call(f"log of step {row['step']}", self.run.log, values, step=row["step"])
            record_wandb_logged_(output_dir, self.run.id, row["step"])
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            self._disable(f"W&B log failed at step {row['step']}, disabling W&B: {exc}")
            return False
        return True

    def _init(self, config: Config, output_dir: Path, attempts: list[dict]) -> Optional[dict]:
        """The attempt that created the W&B run, or None (W&B disabled)."""
        try:
            import wandb
        except Exception as exc:  # noqa: BLE001
            self._disable(f"W&B init failed, continuing without it: {exc}")
            return None
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
            return None if self._disabled else attempt
        self._disable(f"W&B init failed, continuing without it: {'; '.join(failures)}")
        return None


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


def read_wandb_logged(output_dir: Path) -> Optional[dict]:
    """`{"run_id": ID, "step": N}`: the last row W&B took, as the worker recorded it; None when
    nothing is recorded (or the record is unreadable: then every row is sent again)."""
    try:
        logged = json.loads((output_dir / WANDB_LOGGED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return logged if isinstance(logged, dict) and isinstance(logged.get("step"), int) else None


def record_wandb_logged_(output_dir: Path, run_id: str, step: int) -> None:
    """Record that W&B run `run_id` took the row of `step`. Replaced in one rename, not fsynced:
    it must survive a killed process (the page cache does), and after a power loss an older
    record only means rows sent twice (W&B keeps the first of a step)."""
    tmp = output_dir / (WANDB_LOGGED_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "step": step}) + "\n")
    os.replace(tmp, output_dir / WANDB_LOGGED_FILE)


def read_rows(path: Path, steps: range) -> Iterator[dict]:
    """The rows of metrics.jsonl whose step is in `steps`, in file order (one per step after the
    repair at the start), read lazily: the run appends new rows meanwhile."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row, _ = parse_row(line)
            if row is not None and row["step"] in steps:
                yield row


def format_duration(seconds: float) -> str:
    """`H:MM:SS` with as many hours as needed (no wrap at a day). Pure."""
    total = int(round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def console_line(row: Mapping[str, Any], max_steps: int, elapsed: float, steps_done: int) -> str:
    """`step 3/5 | loss 2.1000 | reward 0.512 | grad 0.83 | lr 1.00e-03 | val/loss 2.3000 |
    512 tok/s | 0.25 s/step | eta 0:00:01`, each part only when the row has it. Pure."""
    step = row["step"]
    parts = [f"step {step}/{max_steps}"]
    for key, label, spec in CONSOLE_FIELDS:
        value = row.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {_number(value, spec)}")
    if "perf/throughput" in row:
        parts.append(f"{row['perf/throughput']:.0f} tok/s")
    if "time/step" in row:
        parts.append(f"{row['time/step']:.2f} s/step")
    remaining = max(0, max_steps - step)
    eta = elapsed / steps_done * remaining if steps_done else 0.0
    parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)


def _number(value: float, spec: str) -> str:
    """`value` in `spec`, or in 3 significant digits where `spec` would show a small non-zero
    value as 0 (an RL loss of -3e-7 is not "-0.0000")."""
    if not math.isfinite(value):
        return str(value)
    text = f"{value:{spec}}"
    if value != 0 and float(text) == 0:
        return f"{value:.2e}"
    return text


# The metrics a step's console line shows, in order: (row key, label, format).
CONSOLE_FIELDS = (
    ("loss/mean", "loss", ".4f"),
    ("reward/mean", "reward", ".3f"),
    ("optim/grad_norm", "grad", ".3g"),
    ("optim/lr", "lr", ".2e"),
    ("val/loss", "val/loss", ".4f"),
    ("val/reward/mean", "val/reward", ".3f"),
)


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
