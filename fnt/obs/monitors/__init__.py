"""Where metric rows go: the monitor protocol, the monitors table and the run's monitors behind
one call. Side effects: those of the monitors it builds (files, W&B, the console).

A monitor is a class built on rank 0 as `cls(config, start_step)`, with `log(row)` (once per
step, the row as metrics.jsonl holds it) and `close()` (once, at the end, however the run ends),
and optionally `resume(start_step, rows)`: called before the first row of a resumed run, with a
reader of metrics.jsonl's rows (`rows(range_of_steps)`), so that a monitor with its own history
can catch up (W&B does). The built-in monitors are MONITORS' entries; a user's own are named in
config (`monitors = ["module:Class"]`). Adding a built-in monitor is its file and one entry.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

from fnt.config import Config
from fnt.config.references import import_function
from fnt.obs.monitors.jsonl import read_rows
from fnt.store.rundir import METRICS_FILE

RowsReader = Callable[[range], Iterator[dict]]
"""Reads back the rows of metrics.jsonl whose step is in the range, in step order."""


class Monitor(Protocol):
    """What a run's rows go through (module docstring); `resume` is optional."""

    def log(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MonitorEntry:
    """A built-in monitor: its class, and which runs have it."""

    build: str
    """"module:Class", built on rank 0 as Class(config, start_step)."""
    wanted: Callable[[Config], bool] = lambda config: True
    """Whether a run with this config has the monitor."""


MONITORS: dict[str, MonitorEntry] = {
    # First: every row is in metrics.jsonl before another monitor sees it.
    "jsonl": MonitorEntry("fnt.obs.monitors.jsonl:JsonlMonitor"),
    "wandb": MonitorEntry(
        "fnt.obs.monitors.wandb:WandbMonitor", lambda config: config.wandb.mode != "disabled"
    ),
    "console": MonitorEntry("fnt.obs.monitors.console:ConsoleMonitor"),
}
"""The built-in monitors, in the order each row reaches them."""


class Monitors:
    """All monitors behind one `log(row)` call, in order; metrics.jsonl is written first."""

    def __init__(self, monitors: list[Monitor]) -> None:
        self.monitors = monitors

    def log(self, row: Mapping[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.log(row)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


def monitor_classes(config: Config) -> list[str]:
    """The "module:Class" of each monitor a run with `config` has, in order: the wanted
    built-ins, then config.monitors. Pure."""
    wanted = [entry.build for entry in MONITORS.values() if entry.wanted(config)]
    return wanted + list(config.monitors)


def open_monitors(config: Config, start_step: int) -> Monitors:
    """Build the run's monitors (metrics.jsonl first, trimmed to `start_step`) and, when the run
    resumes, give each its resume hook. A monitor that fails to build closes those before it."""
    rows = functools.partial(read_rows, Path(config.output_dir) / METRICS_FILE)
    with contextlib.ExitStack() as built:
        monitors = []
        for name in monitor_classes(config):
            monitor = import_function(name, 2)(config, start_step)
            built.callback(monitor.close)
            monitors.append(monitor)
        if start_step > 0:
            for monitor in monitors:
                resume = getattr(monitor, "resume", None)
                if resume is not None:
                    resume(start_step, rows)
        built.pop_all()
    return Monitors(monitors)
