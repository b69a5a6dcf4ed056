"""Checkpoints as transactions. Side effects: file I/O and collectives (DCP).

Layout of `{output_dir}/checkpoints/step_N/`: the DCP files of the model and optimizer
(`.metadata`, `__*_*.distcp`), `progress.json` (Progress, with the data position), `meta.json`
(the model directory, for export), `config.json` (the resolved config the checkpoint was written
with, which a resume reconciles with its own: fnt.resume.reconcile_config), `components/NAME.pt`
(the state of each source handle that has one, fnt.state.Component: e.g. the policies an async
rollout engine still samples from) and the marker `COMPLETE`.

How completeness is marked (fnt.transaction): every rank writes into `step_N.partial/`; after a
barrier, rank 0 writes `progress.json`, `meta.json` and `config.json`, fsyncs everything, writes
`COMPLETE`, renames the directory to `step_N` and fsyncs the parent. `resolve_resume_step`
counts only directories named `step_N` that hold `COMPLETE`, so a crash at any moment of a save
leaves the previous checkpoint as the newest complete one. The learning rate is derived from
the step, so there is no scheduler state.

A run that starts at step N first moves newer complete checkpoints and unfinished saves into
`abandoned/<UTC time>/` (fnt.rundir.abandon_newer_), so the new trajectory never meets the old
one.
"""

from __future__ import annotations

import json
import os
import warnings
from functools import partial as bind
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fnt.config import Config, to_json
from fnt.faults import fault_point
from fnt.rundir import (
    COMPLETE_MARKER,
    COMPONENTS_DIR,
    CONFIG_FILE,
    META_FILE,
    PROGRESS_FILE,
    step_dir,
)
from fnt.state import Progress
from fnt.transaction import begin_dir_, commit_dir_, is_complete, partial_dir, write_synced_


def should_checkpoint(step: int, interval: int, max_steps: int, save_final: bool) -> bool:
    """Save after this step? Every `interval` steps, and the final step once. Pure."""
    if step == max_steps:
        return save_final or (interval > 0 and step % interval == 0)
    return interval > 0 and step % interval == 0


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def save_checkpoint_(
    ckpt_root: Path,
    progress: Progress,
    model: Any,
    optimizer: Any,
    *,
    model_name: str,
    rank: int,
    distributed: bool,
    config: Optional[Config] = None,
    components: Mapping[str, Mapping[str, Any]] = {},
) -> Path:
    """Write step_{progress.step} as a transaction (see the module docstring).

    `config`, when given, is recorded as the checkpoint's config.json, for a resume to reconcile;
    `components` are the state dicts of the source handles by name (every rank holds the same
    ones; rank 0 writes those that are not empty).
    """
    final = step_dir(ckpt_root, progress.step)
    partial = partial_dir(final)
    if rank == 0:
        begin_dir_(final)
    _barrier(distributed)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to save in a single process"
        )
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(partial),
            no_dist=not distributed,
        )
    fault_point("shards", progress.step, rank)
    _barrier(distributed)
    if rank == 0:
        write_synced_(partial / PROGRESS_FILE, progress.to_json(sort_keys=True))
        write_synced_(partial / META_FILE, json.dumps({"model_name": os.path.abspath(model_name)}))
        if config is not None:
            write_synced_(partial / CONFIG_FILE, to_json(config) + "\n")
        for name, state in components.items():
            if state:
                (partial / COMPONENTS_DIR).mkdir(exist_ok=True)
                torch.save(dict(state), partial / COMPONENTS_DIR / f"{name}.pt")
        # A step_N left by another trajectory is moved aside at the start; should one still be
        # there (a directory copied in by hand), this save is the one to keep.
        commit_dir_(
            partial,
            final,
            f"step {progress.step}\n",
            replace=True,
            before_rename=bind(fault_point, "marker", progress.step),
        )
        fault_point("committed", progress.step)
    _barrier(distributed)
    return final


def load_checkpoint_(path: Path, model: Any, optimizer: Any, *, distributed: bool) -> Progress:
    """Load model and optimizer state in place from a complete checkpoint; return its Progress."""
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} file)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return read_progress(path)


def read_components(path: Path, device: torch.device) -> dict[str, dict[str, Any]]:
    """The source handles' states a checkpoint holds, by name (empty for none)."""
    directory = Path(path) / COMPONENTS_DIR
    if not directory.is_dir():
        return {}
    return {
        file.stem: torch.load(file, map_location=device, weights_only=True)
        for file in sorted(directory.glob("*.pt"))
    }


def read_progress(path: Path) -> Progress:
    return Progress.from_json((path / PROGRESS_FILE).read_text())


def read_meta(path: Path) -> dict:
    return json.loads((path / META_FILE).read_text())


def read_saved_config(path: Path) -> Optional[dict]:
    """The config a checkpoint was written with, as a plain dict; None for a checkpoint that
    does not record one (written by an fnt that did not, or by a caller that passed none)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    return json.loads(file.read_text())
