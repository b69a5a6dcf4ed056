"""Checkpoints as transactions. Side effects: file I/O and collectives (DCP).

Layout of `{output_dir}/checkpoints/step_N/`: the DCP files of the model and optimizer
(`.metadata`, `__*_*.distcp`), `progress.json` (Progress, with the data position), `meta.json`
(the model directory, for export), `config.json` (the resolved config the checkpoint was written
with, which a resume reconciles with its own: fnt.resume.reconcile_config) and the marker
`COMPLETE`.

How completeness is marked (fnt.transaction): every rank writes into `step_N.partial/`; after a
barrier, rank 0 writes `progress.json`, `meta.json` and `config.json`, fsyncs everything, writes
`COMPLETE`, renames the directory to `step_N` and fsyncs the parent. `resolve_resume_step`
counts only directories named `step_N` that hold `COMPLETE`, so a crash at any moment of a save
leaves the previous checkpoint as the newest complete one. The learning rate is derived from
the step, so there is no scheduler state.

A run that starts at step N first moves newer complete checkpoints and unfinished saves into
`abandoned/<UTC time>/` (`abandon_newer_`), so the new trajectory never meets the old one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from datetime import datetime, timezone
from functools import partial as bind
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fnt.config import Config, to_json
from fnt.faults import fault_point
from fnt.resume import (
    ABANDONED_DIR,
    abandoned_names,
    checkpoint_dir,
    complete_steps,
    list_checkpoints,
    step_of,
)
from fnt.state import Progress
from fnt.transaction import (
    COMPLETE_MARKER,
    begin_dir_,
    commit_dir_,
    fsync_dir,
    is_complete,
    partial_dir,
    write_synced,
)

PROGRESS_FILE = "progress.json"
META_FILE = "meta.json"
CONFIG_FILE = "config.json"


def should_checkpoint(step: int, interval: int, max_steps: int, save_final: bool) -> bool:
    """Save after this step? Every `interval` steps, and the final step once. Pure."""
    if step == max_steps:
        return save_final or (interval > 0 and step % interval == 0)
    return interval > 0 and step % interval == 0


def steps_to_delete(steps: list[int], keep_last: int) -> list[int]:
    """Complete steps beyond the newest `keep_last` (0 keeps all); never the newest one. Pure."""
    if keep_last <= 0:
        return []
    ordered = sorted(steps)
    return ordered[: max(0, len(ordered) - keep_last)]


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def save_checkpoint(
    ckpt_root: Path,
    progress: Progress,
    model: Any,
    optimizer: Any,
    *,
    model_name: str,
    rank: int,
    distributed: bool,
    config: Optional[Config] = None,
) -> Path:
    """Write step_{progress.step} as a transaction (see the module docstring).

    `config`, when given, is recorded as the checkpoint's config.json, for a resume to reconcile.
    """
    final = checkpoint_dir(ckpt_root, progress.step)
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
        write_synced(partial / PROGRESS_FILE, progress.to_json(sort_keys=True))
        write_synced(partial / META_FILE, json.dumps({"model_name": os.path.abspath(model_name)}))
        if config is not None:
            write_synced(partial / CONFIG_FILE, to_json(config) + "\n")
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


def cleanup_checkpoints_(ckpt_root: Path, keep_last: int) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep_last`, and `step_N` directories without
    the marker; returns the deleted steps.

    Only a delete leaves a `step_N` without its marker (the marker goes first, so a crash
    mid-delete leaves a directory that readers ignore); removing those finishes the delete.
    Other names (`step_N.partial`, `abandoned/`, whatever fnt did not write) are never touched.
    """
    entries = list_checkpoints(ckpt_root)
    leftovers = [
        step
        for name, has_marker in entries
        if not has_marker
        and (step := step_of(name)) is not None
        and checkpoint_dir(ckpt_root, step).is_dir()
    ]
    doomed = steps_to_delete(complete_steps(entries), keep_last)
    for step in doomed:
        path = checkpoint_dir(ckpt_root, step)
        (path / COMPLETE_MARKER).unlink()
        fault_point("cleanup", step)
        shutil.rmtree(path)
    for step in leftovers:
        shutil.rmtree(checkpoint_dir(ckpt_root, step))
    return sorted(doomed + leftovers)


def abandon_newer_(ckpt_root: Path, start_step: int) -> list[tuple[Path, Path]]:
    """Move what `abandoned_names` picks into `abandoned/<UTC time>/` under ckpt_root, kept as it
    was; returns the `(from, to)` pairs. Each move is one rename, so a crash in between leaves
    the rest for the next start to move."""
    names = abandoned_names(list_checkpoints(ckpt_root), start_step)
    if not names:
        return []
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    target = Path(ckpt_root) / ABANDONED_DIR / stamp
    target.mkdir(parents=True)
    moves = [(Path(ckpt_root) / name, target / name) for name in names]
    for source, destination in moves:
        os.replace(source, destination)
    fsync_dir(target)
    fsync_dir(Path(ckpt_root))
    return moves
