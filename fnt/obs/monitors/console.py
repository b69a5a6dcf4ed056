"""The console monitor: one line per step on rank 0's stdout (`console_line`) and, after the
line of an RL sample step, a few of its samples (`sample_lines`). Side effects: prints, and reads
back a sample step's {output_dir}/samples/step_N.jsonl (fnt.store.samples). Nothing here goes to
metrics.jsonl. The start-up and end summaries are fnt.obs.console's.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

from fnt.config import Config, mode_of
from fnt.store.samples import is_sample_step, read_step_samples, samples_path

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


def format_duration(seconds: float) -> str:
    """`H:MM:SS` with as many hours as needed (no wrap at a day). Pure."""
    total = int(round(seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def console_line(row: Mapping[str, Any], max_steps: int, elapsed: float, steps_done: int) -> str:
    """`step 3/5 | loss 2.1000 | reward 0.512 | turns 2.25 | len 11.5 | cut 25% | max_turns 50% |
    grad 0.83 | lr 1.00e-03 | val/loss 2.3000 | 512 tok/s | rollout 0.12 s | 0.25 s/step | eta
    0:00:01`, each part only when the row has it (len: sampled tokens per episode; cut: the
    fraction of episodes a length limit cut, max_new_tokens or max_episode_tokens; max_turns:
    the fraction that ran out of turns, answered at rollout.max_turns); a DPO row shows `acc 75%
    | margin 0.412` (rewards/accuracies and rewards/margins) after its loss. Pure."""
    step = row["step"]
    parts = [f"step {step}/{max_steps}"]
    for key, label, spec in (*CONSOLE_FIELDS, *sampled_fields(row), *member_fields(row)):
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
    # DPO: the share of pairs whose chosen side wins, and the mean margin (TRL logs both).
    ("rewards/accuracies", "acc", ".0%"),
    ("rewards/margins", "margin", ".3f"),
    ("rollout/turns/mean", "turns", ".2f"),
    ("rollout/completion_len/mean", "len", ".1f"),
    ("rollout/truncated_fraction", "cut", ".0%"),
    ("rollout/max_turns_fraction", "max_turns", ".0%"),
    ("optim/grad_norm", "grad", ".3g"),
    ("optim/lr", "lr", ".2e"),
    ("val/loss", "val/loss", ".4f"),
    ("val/reward/mean", "val/reward", ".3f"),
    ("val/rewards/accuracies", "val/acc", ".0%"),
    # val.eval_on_start: the start state's, in the first row.
    ("val/start/loss", "val/start/loss", ".4f"),
    ("val/start/reward/mean", "val/start/reward", ".3f"),
)

# Keys named by val.samples = k (fnt.evaluation.held_out): (key prefix, label prefix, format).
SAMPLED_FIELDS = (
    ("val/reward/avg@", "val/avg@", ".3f"),
    ("val/reward/pass@", "val/pass@", ".0%"),
    ("val/start/reward/avg@", "val/start/avg@", ".3f"),
    ("val/start/reward/pass@", "val/start/pass@", ".0%"),
)


def sampled_fields(row: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The console fields of the row's val/reward/avg@k and pass@k keys (k is val.samples). Pure."""
    return [
        (key, label + key[len(prefix) :], spec)
        for prefix, label, spec in SAMPLED_FIELDS
        for key in row
        if key.startswith(prefix)
    ]


def member_fields(row: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The console fields of a mixture's per-member greedy val reward (rollout.environments:
    val/{name}/reward/mean as `val/{name}`, the start state's val/start/{name}/reward/mean as
    `val/start/{name}`). Pure."""
    fields = []
    for key in row:
        parts = key.split("/")
        if parts[0] != "val" or parts[-2:] != ["reward", "mean"]:
            continue
        if len(parts) == 4 and parts[1] not in ("reward", "start"):
            fields.append((key, f"val/{parts[1]}", ".3f"))
        elif len(parts) == 5 and parts[1] == "start" and parts[2] != "reward":
            fields.append((key, f"val/start/{parts[2]}", ".3f"))
    return fields


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
