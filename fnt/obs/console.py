"""What rank 0 prints around the steps: start-up phases, the start and end summaries. A user sees
progress from the first second: one line per start-up phase with the seconds since the start, a
progress bar while data is tokenized (tqdm, only when stdout is a terminal; plain lines otherwise),
the start-up summary and the end summary; the line of each step is the console monitor's
(fnt.obs.monitors.console). Side effects: prints, rank 0 only (the caller says which rank).
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
    max_epochs: float = 0.0,
    ranks: str = "",
    kernels: str = "",
) -> list[str]:
    """The start-up summary: parameters, each data source's samples and tokens, the steps and
    the epochs they make (with `max_epochs`, the steps it was resolved to); `ranks` and
    `kernels`, when given, are the `ranks_text` and `kernels_text` lines. `sources` are
    `{"name", "samples", "dropped", "tokens"}`. Pure."""
    lines = [line for line in (ranks, kernels) if line]
    lines.append(f"parameters: {count_text(parameters)} ({count_text(trainable)} trainable)")
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
    if max_epochs:
        epochs = f", max_epochs {max_epochs:g} resolved to {max_steps} steps"
    elif corpus_tokens:
        epochs = f", about {steps * tokens_per_step / corpus_tokens:.2g} epochs"
    start = f"from step {start_step}, " if start_step else ""
    lines.append(
        f"steps: {steps} ({start}to step {max_steps}), "
        f"{count_text(tokens_per_step)} tokens per step{epochs}"
    )
    return lines


def rl_summary(
    *,
    model: str,
    parameters: int,
    trainable: int,
    start_step: int,
    max_steps: int,
    rollout: Any,
    prompts: Optional[int] = None,
) -> list[str]:
    """The start-up summary of an RL run: the model and its parameters, the engine, prompts per
    step x group size, the reward or environment, async_level, the sampling limits, the steps
    and how often they go through the prompts (`prompts`: how many there are, when known).
    `rollout` is the run's RolloutConfig. Pure."""
    samples = rollout.prompts_per_step * rollout.group_size
    scored_by = [f"reward {rollout.reward}"] * bool(rollout.reward)
    scored_by += [f"environment {rollout.environment}"] * bool(rollout.environment)
    mixed = [f"{e.name} {e.weight:g}" for e in rollout.environments]
    scored_by += [f"environments {', '.join(mixed)}"] * bool(mixed)
    if rollout.environment or mixed:
        scored_by.append(f"max_turns {rollout.max_turns}")
    policy = (
        "on-policy"
        if rollout.async_level == 0
        else f"step n trains on rollouts of the policy after step n-{rollout.async_level + 1}"
    )
    steps = max_steps - start_step
    start = f"from step {start_step}, " if start_step else ""
    passes = ""
    if prompts:
        laps = steps * rollout.prompts_per_step / prompts
        passes = f", about {laps:.2g} passes over {prompts:,} prompts"
    return [
        f"parameters: {count_text(parameters)} ({count_text(trainable)} trainable), model {model}",
        f"rollouts: engine {rollout.engine}, {rollout.prompts_per_step} prompts x "
        f"{rollout.group_size} completions = {samples} samples per step, max_new_tokens "
        f"{rollout.max_new_tokens}, temperature {rollout.temperature:g}",
        f"scored by: {', '.join(scored_by) or 'the rollouts files (external engine)'}; "
        f"async_level {rollout.async_level} ({policy})",
        f"steps: {steps} ({start}to step {max_steps}){passes}",
    ]


def kernels_text(attention: str, compiled: bool, loss: str) -> str:
    """`kernels: attention varlen, compile on, loss eager`: what model.attn_implementation,
    model.compile and model.loss_kernel resolved to on this device. Pure."""
    return f"kernels: attention {attention}, compile {'on' if compiled else 'off'}, loss {loss}"


def ranks_text(world_size: int, dp_replicate: int, dp_shard: int, device: str) -> str:
    """`ranks: 2 on cpu (data-parallel 2: 1 replica x 2 shards)`, so a torchrun launch says how
    many processes train. Pure."""
    layout = (
        f"data-parallel {dp_replicate * dp_shard}: {dp_replicate} "
        f"{'replica' if dp_replicate == 1 else 'replicas'} x {dp_shard} "
        f"{'shard' if dp_shard == 1 else 'shards'}"
    )
    return f"ranks: {world_size} on {device} ({layout})"


# The metrics the end summary follows from the first row to the last.
SUMMARY_KEYS = (("loss/mean", "loss"), ("reward/mean", "reward"), ("val/loss", "val/loss"))


def end_summary(
    first: Optional[Mapping[str, Any]],
    last: Optional[Mapping[str, Any]],
    seconds: float,
    checkpoint: Optional[str],
    best: Optional[str] = None,
) -> str:
    """`done: steps 1..20 in 12.3 s | loss 5.56 -> 3.01 | checkpoint step_20 | best step_8
    (val/loss 2.87, lowest)`; `best` is the best checkpoint's text (ckpt.keep_best). Pure."""
    if first is None or last is None:
        return f"done: no step to run ({seconds:.1f} s)"
    parts = [f"done: steps {first['step']}..{last['step']} in {seconds:.1f} s"]
    for key, label in SUMMARY_KEYS:
        a, b = first.get(key), last.get(key)
        if isinstance(a, float) and isinstance(b, float):
            parts.append(f"{label} {a:.4g} -> {b:.4g}")
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    if best:
        parts.append(f"best {best}")
    return " | ".join(parts)
