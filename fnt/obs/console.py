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

from fnt.config import Config, mode_of
from fnt.store.samples import is_sample_step, read_step_samples, samples_path

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
    if rollout.environment:
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


CONSOLE_SAMPLES = 3
"""How many of a sample step's completions the console shows (its file has them all)."""


def _clip(text: str, limit: int, tail: bool = False) -> str:
    """`text` as a Python literal of at most about `limit` characters (its end when `tail`)."""
    if len(text) > limit:
        text = "..." + text[-limit:] if tail else text[:limit] + "..."
    return repr(text)


def sample_lines(step: int, records: Sequence[Mapping[str, Any]], where: str) -> list[str]:
    """A few of a step's saved samples for the console: the best, a middle and the worst
    reward (NaN last), each with its reward, length, whether a length limit cut it or it ran out
    of turns, the end of its prompt and the start of its completion. Pure."""
    ranked = sorted(
        range(len(records)),
        key=lambda i: -records[i]["reward"] if records[i]["reward"] is not None else math.inf,
    )
    picks = (
        sorted({ranked[0], ranked[len(ranked) // 2], ranked[-1]}, key=ranked.index)
        if ranked
        else []
    )
    lines = [f"samples of step {step}: {len(picks)} of {len(records)} (all in {where})"]
    for i in picks[:CONSOLE_SAMPLES]:
        record = records[i]
        reward = "nan" if record["reward"] is None else f"{record['reward']:.3f}"
        cut = ", cut by a length limit" if record["truncated"] else ""
        cut += ", out of turns" if record.get("out_of_turns") else ""
        lines.append(
            f"  reward {reward} | {record['completion_tokens']} tokens{cut} | "
            f"{_clip(record['prompt'], 60, tail=True)} -> {_clip(record['completion'], 160)}"
        )
    return lines


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


def format_duration(seconds: float) -> str:
    """`H:MM:SS` with as many hours as needed (no wrap at a day). Pure."""
    total = int(round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def console_line(row: Mapping[str, Any], max_steps: int, elapsed: float, steps_done: int) -> str:
    """`step 3/5 | loss 2.1000 | reward 0.512 | turns 2.25 | len 11.5 | cut 25% | max_turns 50% |
    grad 0.83 | lr 1.00e-03 | val/loss 2.3000 | 512 tok/s | rollout 0.12 s | 0.25 s/step | eta
    0:00:01`, each part only when the row has it (len: sampled tokens per episode; cut: the
    fraction of episodes a length limit cut, max_new_tokens or max_episode_tokens; max_turns:
    the fraction that ran out of turns, answered at rollout.max_turns). Pure."""
    step = row["step"]
    parts = [f"step {step}/{max_steps}"]
    for key, label, spec in CONSOLE_FIELDS:
        value = row.get(key)
        if isinstance(value, float):
            parts.append(f"{label} {_number(value, spec)}")
    if "perf/throughput" in row:
        parts.append(f"{row['perf/throughput']:.0f} tok/s")
    if isinstance(row.get("time/rollout"), float):
        parts.append(f"rollout {row['time/rollout']:.2f} s")
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
    if text.endswith("%"):
        return text
    if value != 0 and float(text) == 0:
        return f"{value:.2e}"
    return text


# The metrics a step's console line shows, in order: (row key, label, format).
CONSOLE_FIELDS = (
    ("loss/mean", "loss", ".4f"),
    ("reward/mean", "reward", ".3f"),
    ("rollout/turns/mean", "turns", ".2f"),
    ("rollout/completion_len/mean", "len", ".1f"),
    ("rollout/truncated_fraction", "cut", ".0%"),
    ("rollout/max_turns_fraction", "max_turns", ".0%"),
    ("optim/grad_norm", "grad", ".3g"),
    ("optim/lr", "lr", ".2e"),
    ("val/loss", "val/loss", ".4f"),
    ("val/reward/mean", "val/reward", ".3f"),
    # val.eval_on_start: the start state's, in the first row.
    ("val/start/loss", "val/start/loss", ".4f"),
    ("val/start/reward/mean", "val/start/reward", ".3f"),
)


class ConsoleMonitor:
    """One line per step on stdout; in RL, after the line of a sample step, a few of its
    samples, read back from {output_dir}/samples/step_N.jsonl (fnt.store.samples)."""

    def __init__(self, config: Config, start_step: int) -> None:
        self.max_steps = config.max_steps
        self.start_step = start_step
        self.started = time.perf_counter()
        self.output_dir = config.output_dir
        rollouts = mode_of(config).rollouts  # fnt.config.modes
        self.samples_every = config.rollout.log_samples_every if rollouts else None

    def log(self, row: Mapping[str, Any]) -> None:
        elapsed = time.perf_counter() - self.started
        step = row["step"]
        print(console_line(row, self.max_steps, elapsed, step - self.start_step), flush=True)
        if self.samples_every is None or not is_sample_step(
            step, self.samples_every, self.max_steps
        ):
            return
        records = read_step_samples(self.output_dir, step)
        if records:
            where = str(samples_path(self.output_dir, step))
            print("\n".join(sample_lines(step, records, where)), flush=True)

    def close(self) -> None:
        pass
