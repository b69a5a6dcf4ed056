"""Weights & Biases as a monitor: rows logged from a thread of its own, and a resumed run's W&B
run made to hold the rows of metrics.jsonl. Side effects: W&B calls, and {output_dir}/wandb_id
and wandb_logged.

A W&B failure is a warning, never a crash, and never costs the metrics.jsonl row (that row is
written first, by the JSONL monitor).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from fnt.config import Config, to_plain
from fnt.faults import fault_point
from fnt.store.rundir import METRICS_FILE, WANDB_ID_FILE, WANDB_LOGGED_FILE
from fnt.store.samples import read_step_samples
from fnt.store.transaction import write_synced_

if TYPE_CHECKING:
    from fnt.obs.monitors import RowsReader


@dataclass(frozen=True)
class _Replay:
    """The worker's order to send again the rows the W&B run lacks (WandbMonitor.resume)."""

    rows: RowsReader


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
    run knows how far W&B had got: its resume hook has the worker send again, in step order,
    the rows of metrics.jsonl that the rewound or forked W&B run lacks (`replay_steps`), and
    the W&B run ends up holding the rows of metrics.jsonl.
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
        self.output_dir = output_dir
        attempts = wandb_init_attempts(
            recorded_wandb_run_id(output_dir), start_step, uuid.uuid4().hex[:12]
        )
        self._logged, problem = read_wandb_logged(output_dir)
        if problem:
            print(problem, flush=True)
        self._thread = threading.Thread(
            target=self._work, args=(config, output_dir, attempts), name="fnt-wandb", daemon=True
        )
        self._thread.start()

    @property
    def disabled(self) -> bool:
        return self._disabled

    def resume(self, start_step: int, rows: RowsReader) -> None:
        """Before the resumed run's rows, send again the rows of metrics.jsonl that the W&B run
        lacks (`replay_steps`: how far the rewound or forked run had got)."""
        if not self._disabled:
            self._queue.put_nowait(_Replay(rows))

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
        while True:
            item = self._queue.get()
            if self._disabled:
                return
            if item is None:
                try:
                    self._call("finish", self.run.finish)
                except Exception as exc:  # noqa: BLE001 - W&B must never stop training
                    self._disable(f"W&B finish failed: {exc}")
                return
            if isinstance(item, _Replay):
                sent = self._replay(replay_steps(attempt, self._logged, self.start_step), item)
            else:
                sent = self._send(item, output_dir)
            if not sent:
                return

    def _replay(self, steps: range, replay: _Replay) -> bool:
        """Send the rows of `steps` read back from metrics.jsonl; False when W&B got disabled."""
        if not steps:
            return True
        replayed = 0
        for row in replay.rows(steps):
            if self._disabled or not self._send(row, self.output_dir):
                return False
            replayed += 1
        print(
            f"W&B: sent again the {replayed} rows it lacked (steps {steps.start}.."
            f"{steps.stop - 1} of {METRICS_FILE})",
            flush=True,
        )
        return True

    def _send(self, row: Mapping[str, Any], output_dir: Path) -> bool:
        """Log one row, with its step's samples as a table when the step saved some
        (fnt.store.samples: a resend after a resume reads the same file); record its step as
        taken. False (W&B disabled) when the call fails."""
        try:
            values = {k: v for k, v in row.items() if k != "step"}
            records = read_step_samples(output_dir, row["step"])
            if records:
                values["samples"] = samples_table(self._wandb, records)
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
        self._wandb = wandb
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


SAMPLE_COLUMNS = (
    "step",
    "index",
    "rank",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "completion_tokens",
    "turns",
    "truncated",
    "out_of_turns",
    "policy_step",
)
"""The columns of a step's W&B samples table, then `reward/{name}` per named reward."""


def samples_table(wandb: Any, records: list[dict]) -> Any:
    """A `wandb.Table` of a step's saved samples (one row each, SAMPLE_COLUMNS then the named
    rewards' columns)."""
    names = sorted({name for record in records for name in record.get("rewards", {})})
    columns = [*SAMPLE_COLUMNS, *(f"reward/{name}" for name in names)]
    data = [
        [record.get(key) for key in SAMPLE_COLUMNS]
        + [record.get("rewards", {}).get(name) for name in names]
        for record in records
    ]
    return wandb.Table(columns=columns, data=data)


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


def read_wandb_logged(output_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    """`{"run_id": ID, "step": N}`: the last row W&B took, as the worker recorded it; None when
    nothing is recorded. A record that is there but cannot be read is None too (the safe
    default: every row is sent again, and W&B keeps the first row of a step), with a line
    saying so."""
    path = output_dir / WANDB_LOGGED_FILE
    if not path.exists():
        return None, None
    try:
        logged = json.loads(path.read_text(encoding="utf-8"))
        step = logged.get("step") if isinstance(logged, dict) else None
        if type(step) is not int or not isinstance(logged.get("run_id"), str):
            raise ValueError('expected {"run_id": ID, "step": N}')
    except (OSError, ValueError) as exc:  # JSON and UTF-8 errors too
        return None, (
            f"{path}: unreadable ({exc}); W&B is sent every row of {METRICS_FILE} again (it "
            "keeps the first row of a step)"
        )
    return logged, None


def record_wandb_logged_(output_dir: Path, run_id: str, step: int) -> None:
    """Record that W&B run `run_id` took the row of `step`. Replaced in one rename, not fsynced:
    it must survive a killed process (the page cache does), and after a power loss an older
    record only means rows sent twice (W&B keeps the first of a step)."""
    tmp = output_dir / (WANDB_LOGGED_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "step": step}) + "\n")
    os.replace(tmp, output_dir / WANDB_LOGGED_FILE)
