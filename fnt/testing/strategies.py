"""Hypothesis strategies of what fnt's rules and properties run over. Pure, except
`write_listing_`, which creates the directory a listing describes.

fnt's own tests draw from these too: the resume rules over checkpoint listings, the repair of
metrics.jsonl over damaged files, the metric merge over metric dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from hypothesis import strategies as st

from fnt.config import (
    CkptConfig,
    Config,
    ModelConfig,
    OptimConfig,
    RLConfig,
    RolloutConfig,
    RuntimeConfig,
    ScheduleConfig,
)
from fnt.faults import PHASES, Fault
from fnt.obs.monitors.jsonl import strict_json_line
from fnt.store.rundir import step_dir
from fnt.store.transaction import COMPLETE_MARKER, partial_dir

STEPS = st.integers(min_value=0, max_value=60)
# Names in a checkpoint directory that are never a checkpoint, with or without a marker inside.
UNRELATED = (
    "foo",
    "step_x",
    "step_-1",
    "step_",
    "STEP_3",
    "step_3_old",
    "step_3.bak",
    "latest",
    "step",
)
# The phases a single-process run passes without W&B (fnt.faults.PHASES less "wandb").
RUN_PHASES = tuple(phase for phase in PHASES if phase != "wandb")


@st.composite
def tiny_configs(
    draw,
    model_dir: Union[str, Path],
    output_dir: Union[str, Path],
    *,
    kind: str = "sft",
    ranks: int = 1,
    prompts: Union[str, Path, None] = None,
) -> Union[Config, RLConfig]:
    """A config of the tiny model that `fnt.validate(config, ranks)` accepts: a short run
    (2 to 6 steps) with checkpoints, drawn batch layout, optimizer, schedule and seed; SFT on
    synthetic data, or (kind="rl") RL with the in-process engine on the `prompts` file."""
    micro = draw(st.sampled_from((1, 2)))
    batch = micro * ranks * draw(st.sampled_from((1, 2)))
    max_steps = draw(st.integers(2, 6))
    common = dict(
        model=ModelConfig(name=str(model_dir)),
        output_dir=str(output_dir),
        seed=draw(st.integers(0, 2**16)),
        max_steps=max_steps,
        batch_size=batch,
        micro_batch_size=micro,
        optim=OptimConfig(
            lr=draw(st.sampled_from((1e-3, 3e-3))), max_norm=draw(st.sampled_from((0.0, 1.0)))
        ),
        schedule=ScheduleConfig(
            kind=draw(st.sampled_from(("constant", "linear", "cosine"))),
            warmup_steps=draw(st.integers(0, 2)),
        ),
        ckpt=CkptConfig(
            interval=draw(st.integers(1, max_steps)), keep_last=draw(st.integers(0, 2))
        ),
        runtime=RuntimeConfig(num_threads=1),
    )
    if kind == "sft":
        return Config(seq_len=draw(st.sampled_from((32, 64))), **common)
    if kind != "rl" or prompts is None:
        raise ValueError("tiny_configs: kind is 'sft', or 'rl' with a prompts file")
    prompts_per_step = ranks * draw(st.sampled_from((1, 2)))
    rollout = RolloutConfig(
        prompts=str(prompts),
        reward="ascii_letters",
        prompts_per_step=prompts_per_step,
        group_size=draw(st.sampled_from((2, 4))),
        max_new_tokens=draw(st.integers(4, 12)),
    )
    # Every sample gets a row of its own at most: batch_size rows hold them all.
    rows = max(batch, prompts_per_step * rollout.group_size)
    rows = -(-rows // (micro * ranks)) * micro * ranks
    return RLConfig(seq_len=128, rollout=rollout, **{**common, "batch_size": rows})


def crash_points(max_steps: int, ranks: int = 1, phases=RUN_PHASES) -> st.SearchStrategy[Fault]:
    """Where a run may be killed (fnt.faults): a phase, a step 1..max_steps, a rank."""
    return st.builds(
        Fault, st.sampled_from(phases), st.integers(1, max_steps), st.integers(0, ranks - 1)
    )


@st.composite
def checkpoint_listings(draw) -> dict[str, Any]:
    """A checkpoint directory: complete checkpoints, and entries a crash or a stranger leaves
    (a step_N without its marker, a marker that is a directory, a step_N that is a file, a
    step_N.partial holding the marker, unrelated names), with distinct names."""
    complete = draw(st.sets(STEPS, max_size=6))
    unmarked = draw(st.sets(STEPS, max_size=4)) - complete
    marker_is_dir = draw(st.sets(STEPS, max_size=2)) - complete - unmarked
    as_file = draw(st.sets(STEPS, max_size=2)) - complete - unmarked - marker_is_dir
    partial = draw(st.sets(STEPS, max_size=4))  # a crashed rename
    unrelated = draw(
        st.lists(
            st.tuples(st.sampled_from(UNRELATED), st.sampled_from(["dir", "marked", "file"])),
            unique_by=lambda t: t[0],
            max_size=4,
        )
    )
    return {
        "complete": complete,
        "unmarked": unmarked,
        "marker_is_dir": marker_is_dir,
        "as_file": as_file,
        "partial": partial,
        "unrelated": unrelated,
    }


def write_listing_(root: Path, listing: dict[str, Any]) -> None:
    """Create the checkpoint directory `listing` (from `checkpoint_listings`) describes."""
    root.mkdir(parents=True, exist_ok=True)
    for n in listing["complete"]:
        step_dir(root, n).mkdir()
        (step_dir(root, n) / "progress.json").write_text("{}")
        (step_dir(root, n) / COMPLETE_MARKER).write_text(f"step {n}\n")
    for n in listing["unmarked"]:
        step_dir(root, n).mkdir()
        (step_dir(root, n) / "progress.json").write_text("{}")
    for n in listing["marker_is_dir"]:
        (step_dir(root, n) / COMPLETE_MARKER).mkdir(parents=True)
    for n in listing["as_file"]:
        step_dir(root, n).write_text(COMPLETE_MARKER)
    for n in listing["partial"]:  # a step_N.partial (fnt.store.transaction)
        partial = partial_dir(step_dir(root, n))
        partial.mkdir()
        (partial / COMPLETE_MARKER).write_text(f"step {n}\n")
    for name, kind in listing["unrelated"]:
        if kind == "file":
            (root / name).write_text("x")
        else:
            (root / name).mkdir()
            if kind == "marked":
                (root / name / COMPLETE_MARKER).write_text("x")


@st.composite
def metrics_files(draw, max_step: int = 40) -> tuple[list[str], list[Any]]:
    """The lines of a metrics.jsonl as crashes, forks and a bad disk leave it: rows with steps
    (some repeated, some absent), torn and garbled lines, blank lines, a last line without its
    newline. Returns the lines and, per line, the step of a good row (None for other lines)."""
    steps = draw(st.lists(st.integers(1, max_step), max_size=15))
    lines, good = [], []
    for step in steps:
        line = strict_json_line({"step": step, "loss/mean": draw(st.floats(allow_nan=False))})
        if draw(st.integers(0, 5)) == 0:
            cut = draw(st.integers(1, len(line) - 1))
            lines.append(line[:cut] + "\n")  # torn: never valid JSON, the object is unclosed
            good.append(None)
        else:
            lines.append(line + "\n")
            good.append(step)
        if draw(st.integers(0, 8)) == 0:
            lines.append(draw(st.sampled_from(["\n", '{"step": 0}\n', "[1]\n"])))
            good.append(None)
    if draw(st.booleans()) and lines:
        lines[-1] = lines[-1].rstrip("\n")
    return lines, good


METRIC_KEYS = st.text(alphabet="abcdefgh_/", min_size=1, max_size=10).filter(
    lambda k: k not in ("step", "time")
)


def metric_dicts(finite: bool = True) -> st.SearchStrategy[dict[str, float]]:
    """Metric dicts as step functions return them (after the host sync): names to floats, NaN
    and infinities too unless `finite`."""
    values = st.floats(allow_nan=not finite, allow_infinity=not finite)
    return st.dictionaries(METRIC_KEYS, values, max_size=8)
