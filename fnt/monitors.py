"""Where metric rows go: metrics.jsonl, Weights & Biases, the console. Side effects: files, W&B.

`Monitors.log(row)` is the one call per step. Only rank 0 creates monitors. A W&B failure is a
warning, never a crash, and never costs the metrics.jsonl row (that row is written first).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping

from fnt.config import Config, to_plain
from fnt.metrics import finite_or_none

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


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
    """Drop rows beyond `last_step` (left by a crashed run) so each step keeps exactly one row."""
    if not path.exists():
        return
    kept = rows_through(path.read_text().splitlines(keepends=True), last_step)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


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


class WandbMonitor:
    """Weights & Biases logging; every failure becomes a warning and disables W&B for the run."""

    def __init__(self, config: Config, start_step: int) -> None:
        self.run = None
        try:
            import wandb

            run_id = wandb_run_id_(Path(config.output_dir), fresh=start_step == 0)
            self.run = wandb.init(
                project=config.wandb.project,
                name=config.wandb.name or None,
                id=run_id,
                resume="allow",
                mode=config.wandb.mode,
                dir=config.output_dir,
                config=to_plain(config),
            )
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            warnings.warn(f"W&B init failed, continuing without it: {exc}", stacklevel=2)
            self.run = None

    def log(self, row: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        try:
            values = {k: v for k, v in row.items() if k != "step"}
            self.run.log(values, step=row["step"])
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            warnings.warn(
                f"W&B log failed at step {row['step']}, disabling W&B: {exc}", stacklevel=2
            )
            self.run = None

    def close(self) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"W&B finish failed: {exc}", stacklevel=2)


def wandb_run_id_(output_dir: Path, fresh: bool) -> str:
    """The W&B run id recorded in the run directory; a fresh run records a new one."""
    path = output_dir / WANDB_ID_FILE
    if not fresh and path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


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


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (for tests, evals and users' notebooks)."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
