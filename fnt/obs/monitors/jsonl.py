"""metrics.jsonl: one strict-JSON row per step, and its repair when a run resumes. Side effects:
appends to (and on resume rewrites) {output_dir}/metrics.jsonl and metrics_missing.json.

The JSONL monitor is the first of every run's monitors: a row is in metrics.jsonl, fsynced,
before any other monitor sees it, and every other monitor can read the rows back from it
(`read_rows`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Optional

from fnt.config import Config
from fnt.obs.metrics import finite_or_none
from fnt.store.jsonl import json_problem
from fnt.store.rundir import METRICS_FILE, METRICS_MISSING_FILE, read_missing_steps, step_ranges
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
    known, problem = read_missing_steps(missing_file)
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
    return [problem] * bool(problem) + repair.messages(str(path), missing_file.name, known)


class JsonlMonitor:
    """Appends one strict-JSON line per step to metrics.jsonl, flushed and fsynced every step.

    The fsync keeps "row N before checkpoint step_N" true through a power loss too: the
    checkpoint's commit is fsynced, so the row before it must be as well.
    """

    def __init__(self, config: Config, start_step: int) -> None:
        path = Path(config.output_dir) / METRICS_FILE
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


def read_rows(path: Path, steps: range) -> Iterator[dict]:
    """The rows of metrics.jsonl whose step is in `steps`, in file order (one per step after the
    repair at the start), read lazily: the run appends new rows meanwhile."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row, _ = parse_row(line)
            if row is not None and row["step"] in steps:
                yield row
