"""What rank 0 prints while a run starts and when it ends, so that a user sees progress from the
first second: one line per start-up phase with the seconds since the start, a progress bar while
data is tokenized (tqdm, only when stdout is a terminal; plain lines otherwise), the start-up
summary and the end summary. Side effects: prints, rank 0 only (the caller says which rank).
Nothing here goes to metrics.jsonl.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

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
