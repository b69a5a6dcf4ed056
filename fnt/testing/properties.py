"""Two properties a user points at a step function and a source of their own. Side effects:
each runs fnt's driver (`fnt.run`) several times in a temporary directory: in this process, and
in spawned processes that kill themselves at a fault point (fnt.faults).

The step function and the source reach those processes by reference, so they must be
importable (module-level functions, as `sft_step` and `rl_step` are). The properties run one
process per run (no torchrun); the config is used as given, but for its output_dir.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from fnt.config import Config, WandbConfig
from fnt.faults import FAULT_ENV, Fault, parse_fault
from fnt.loop import run
from fnt.obs.monitors.jsonl import strict_json_line
from fnt.store.rundir import (
    METRICS_FILE,
    WANDB_ID_FILE,
    ckpt_root,
    complete_steps,
    list_step_dirs,
    step_dir,
)

WANDB_STUB = Path(__file__).resolve().parent / "wandb_stub"
"""A directory holding a stand-in `wandb` package with a server-side history (see its
docstring): first on PYTHONPATH, a run's W&B calls go to it."""

StepFn = Callable[..., Any]
FaultSpec = Union[Fault, str]


def measured_key(key: str) -> bool:
    """Whether a row key holds a measurement of the run (the clock, speeds, the disk), which
    two runs of the same steps never share, rather than a result of its steps. Pure."""
    return key == "time" or key.startswith(("time/", "perf/", "system/")) or "per_second" in key


def results(rows: Sequence[dict]) -> list[dict]:
    """The rows without their measured keys. Pure."""
    return [{k: v for k, v in row.items() if not measured_key(k)} for row in rows]


def read_rows(output_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl, parsed (an unparsable line fails the property)."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_resume_exact(
    config: Config,
    step_fn: StepFn,
    source: StepFn,
    kill_at: Optional[FaultSpec] = None,
    *,
    workdir: Union[str, Path, None] = None,
) -> None:
    """A run killed at `kill_at` ("PHASE@STEP", fnt.faults; default: after the row of the middle
    step) and resumed with `resume = "latest"` writes the rows of the uninterrupted run (every
    key but the measured ones, `measured_key`), one per step, and its last checkpoint holds the
    same weights, bit for bit. AssertionError naming the first difference otherwise.

    The uninterrupted run is made once per config, step function and source in a `workdir`."""
    fault = _fault(kill_at, config)
    work = Path(workdir or tempfile.mkdtemp(prefix="fnt-testing-"))
    reference = _uninterrupted(config, step_fn, source, work)
    crashed = work / f"killed_{fault.phase}_{fault.step}"
    _spawn(_writing_to(config, crashed), step_fn, source, env={FAULT_ENV: _spec(fault)})
    _run_here(dataclasses.replace(_writing_to(config, crashed), resume="latest"), step_fn, source)
    expected, got = read_rows(reference), read_rows(crashed)
    assert [r["step"] for r in got] == [r["step"] for r in expected], (
        f"killed at {fault.phase}@{fault.step} and resumed, metrics.jsonl has the steps "
        f"{[r['step'] for r in got]}, the uninterrupted run {[r['step'] for r in expected]}"
    )
    for a, b in zip(results(expected), results(got)):
        assert a == b, (
            f"killed at {fault.phase}@{fault.step} and resumed, row {a['step']} differs: "
            f"{_diff(a, b)}"
        )
    _assert_same_weights(reference, crashed, fault)


def assert_one_row_per_step(
    config: Config,
    step_fn: StepFn,
    source: StepFn,
    crashes: Sequence[FaultSpec] = (),
    *,
    workdir: Union[str, Path, None] = None,
) -> None:
    """A run killed at each of `crashes` in turn, resumed with `resume = "latest"` after each and
    at last run to its end: every line of metrics.jsonl is a row, it holds each step
    1..max_steps exactly once, and the W&B run (the stub of WANDB_STUB, offline) holds the same
    rows (and the samples tables of the steps that saved samples). AssertionError naming what
    is wrong otherwise."""
    work = Path(workdir or tempfile.mkdtemp(prefix="fnt-testing-"))
    out, history = work / "run", work / "wandb_history"
    history.mkdir(parents=True, exist_ok=True)
    logged = dataclasses.replace(
        _writing_to(config, out), wandb=WandbConfig(mode="offline", project="fnt-testing")
    )
    stub = {"SLOW_WANDB_HISTORY": str(history), "WANDB_SILENT": "true"}
    for n, crash in enumerate(crashes):
        run = logged if n == 0 else dataclasses.replace(logged, resume="latest")
        _spawn(run, step_fn, source, env={**stub, FAULT_ENV: _spec(_fault(crash, config))})
    final = logged if not crashes else dataclasses.replace(logged, resume="latest")
    _spawn(final, step_fn, source, env=stub)
    rows = read_rows(out)
    steps = [row["step"] for row in rows]
    assert steps == list(range(1, config.max_steps + 1)), (
        f"after the kills {[_spec(_fault(c, config)) for c in crashes]} metrics.jsonl holds the "
        f"steps {steps}, not each of 1..{config.max_steps} once"
    )
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    server = json.loads((history / f"{run_id}.json").read_text())
    # Beside a sample step's row W&B also holds its samples table (rollout.log_samples_every),
    # which the run directory keeps in samples/ instead: the rows are the rest.
    wandb_rows = [
        {"step": int(step), **{k: v for k, v in values.items() if not _is_table(v)}}
        for step, values in server.items()
    ]
    assert _strict(wandb_rows) == _strict(rows), (
        f"the W&B run holds the steps {[r['step'] for r in wandb_rows]}, and its rows differ "
        "from metrics.jsonl's"
    )


def _fault(kill_at: Optional[FaultSpec], config: Config) -> Fault:
    if kill_at is None:
        return Fault("row", max(1, config.max_steps // 2), 0)
    return parse_fault(kill_at) if isinstance(kill_at, str) else Fault(*kill_at)


def _spec(fault: Fault) -> str:
    return f"{fault.phase}@{fault.step}:{fault.rank}"


def _writing_to(config: Config, output_dir: Path) -> Config:
    return dataclasses.replace(config, output_dir=str(output_dir), resume=None)


_UNINTERRUPTED: dict[tuple, Path] = {}


def _uninterrupted(config: Config, step_fn: StepFn, source: StepFn, work: Path) -> Path:
    key = (config, step_fn, source, str(work))
    if key not in _UNINTERRUPTED:
        out = work / "uninterrupted"
        _run_here(_writing_to(config, out), step_fn, source)
        _UNINTERRUPTED[key] = out
    return _UNINTERRUPTED[key]


def _run_here(config: Config, step_fn: StepFn, source: StepFn) -> None:
    run(config, step_fn, source)


def _spawn(config: Config, step_fn: StepFn, source: StepFn, env: dict[str, str]) -> None:
    """Run the driver in a fresh process with `env`; with a fault point (FNT_FAULT) in `env`
    it may die by SIGKILL there, or finish when the run never reaches that point."""
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_child, args=(config, step_fn, source, env))
    child.start()
    child.join()
    killed_at_fault = child.exitcode == -signal.SIGKILL and FAULT_ENV in env
    assert child.exitcode == 0 or killed_at_fault, (
        f"the run in a fresh process (env {env}) exited with {child.exitcode}"
    )


def _child(config: Config, step_fn: StepFn, source: StepFn, env: dict[str, str]) -> None:
    os.environ.update(env)
    if "SLOW_WANDB_HISTORY" in env:  # W&B's calls go to the stub, which keeps its history
        sys.path.insert(0, str(WANDB_STUB))
    _run_here(config, step_fn, source)


def _last_checkpoint(output_dir: Path) -> Path:
    root = ckpt_root(output_dir)
    steps = complete_steps(list_step_dirs(root))
    assert steps, f"{root} holds no complete checkpoint"
    return step_dir(root, steps[-1])


def _assert_same_weights(reference: Path, crashed: Path, fault: Fault) -> None:
    a, b = _model_tensors(_last_checkpoint(reference)), _model_tensors(_last_checkpoint(crashed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (
            f"killed at {fault.phase}@{fault.step} and resumed, the final weights differ at {name}"
        )


def _model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "state.pt"
        dcp_to_torch_save(checkpoint, target)
        return torch.load(target, weights_only=False)["model"]


def _is_table(value: Any) -> bool:
    """Whether a value the W&B stub holds is a wandb.Table (kept as JSON with `_type`)."""
    return isinstance(value, dict) and value.get("_type") == "table"


def _strict(rows: Sequence[dict]) -> list[str]:
    return [strict_json_line({k: v for k, v in sorted(row.items())}) for row in rows]


def _diff(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))
