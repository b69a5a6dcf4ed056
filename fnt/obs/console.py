"""What rank 0 prints: start-up phases, start and end summaries, one line per step. A user sees
progress from the first second: one line per start-up phase with the seconds since the start, a
progress bar while data is tokenized (tqdm, only when stdout is a terminal; plain lines otherwise),
the start-up summary, the end summary, and the console monitor's one line per step. Side effects:
prints, rank 0 only (the caller says which rank). Nothing here goes to metrics.jsonl.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from fnt.config import Config

_STARTED = time.perf_counter()


def say(enabled: bool, text: str) -> None:
    """One start-up line, `[  2.3 s] text`, counted from this module's import (the command's
    start, to within the import of fnt)."""
    if enabled:
        print(f"[{time.perf_counter() - _STARTED:6.1f} s] {text}", flush=True)


def with_progress(records: Iterable, label: str, enabled: bool) -> Iterator:
    """`records`, with a bar (count and rate) while they are read when stdout is a terminal,
    else one plain line when they are done; nothing when not `enabled`."""
    if not enabled:
        yield from records
        return
    if sys.stdout.isatty():
        from tqdm import tqdm

        with tqdm(records, desc=label, unit=" records", file=sys.stdout, leave=True) as bar:
            yield from bar
        return
    started, count = time.perf_counter(), 0
    for count, record in enumerate(records, 1):
        yield record
    seconds = time.perf_counter() - started
    rate = f", {count / seconds:,.0f} records/s" if seconds > 0 else ""
    say(True, f"{label}: {count:,} records in {seconds:.1f} s{rate}")


def count_text(n: int) -> str:
    """`1.23M`, `45.6k`, `789`. Pure."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def start_summary(
    *,
    parameters: int,
    trainable: int,
    start_step: int,
    max_steps: int,
    tokens_per_step: int,
    sources: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """The start-up summary: parameters, each data source's samples and tokens, the steps and
    the epochs they make. `sources` are `{"name", "samples", "dropped", "tokens"}`. Pure."""
    lines = [f"parameters: {count_text(parameters)} ({count_text(trainable)} trainable)"]
    corpus_tokens = 0
    for source in sources:
        corpus_tokens += source["tokens"]
        dropped = f", {source['dropped']:,} dropped" if source["dropped"] else ""
        lines.append(
            f"data {source['name']}: {source['samples']:,} samples{dropped}, "
            f"{count_text(source['tokens'])} tokens"
        )
    steps = max_steps - start_step
    epochs = ""
    if corpus_tokens:
        epochs = f", about {steps * tokens_per_step / corpus_tokens:.2g} epochs"
    start = f"from step {start_step}, " if start_step else ""
    lines.append(
        f"steps: {steps} ({start}to step {max_steps}), "
        f"{count_text(tokens_per_step)} tokens per step{epochs}"
    )
    return lines


# The metrics the end summary follows from the first row to the last.
SUMMARY_KEYS = (("loss/mean", "loss"), ("reward/mean", "reward"), ("val/loss", "val/loss"))


def end_summary(
    first: Optional[Mapping[str, Any]],
    last: Optional[Mapping[str, Any]],
    seconds: float,
    checkpoint: Optional[str],
) -> str:
    """`done: steps 1..20 in 12.3 s | loss 5.56 -> 3.01 | checkpoint step_20`. Pure."""
    if first is None or last is None:
        return f"done: no step to run ({seconds:.1f} s)"
    parts = [f"done: steps {first['step']}..{last['step']} in {seconds:.1f} s"]
    for key, label in SUMMARY_KEYS:
        a, b = first.get(key), last.get(key)
        if isinstance(a, float) and isinstance(b, float):
            parts.append(f"{label} {a:.4g} -> {b:.4g}")
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """`H:MM:SS` with as many hours as needed (no wrap at a day). Pure."""
    total = int(round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def console_line(row: Mapping[str, Any], max_steps: int, elapsed: float, steps_done: int) -> str:
    """`step 3/5 | loss 2.1000 | reward 0.512 | turns 2.25 | grad 0.83 | lr 1.00e-03 |
    val/loss 2.3000 | 512 tok/s | 0.25 s/step | eta 0:00:01`, each part only when the row has
    it. Pure."""
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
    ("rollout/turns/mean", "turns", ".2f"),
    ("optim/grad_norm", "grad", ".3g"),
    ("optim/lr", "lr", ".2e"),
    ("val/loss", "val/loss", ".4f"),
    ("val/reward/mean", "val/reward", ".3f"),
)


class ConsoleMonitor:
    """One line per step on stdout."""

    def __init__(self, config: Config, start_step: int) -> None:
        self.max_steps = config.max_steps
        self.start_step = start_step
        self.started = time.perf_counter()

    def log(self, row: Mapping[str, Any]) -> None:
        elapsed = time.perf_counter() - self.started
        line = console_line(row, self.max_steps, elapsed, row["step"] - self.start_step)
        print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        pass
