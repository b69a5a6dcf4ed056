"""Checkpoints as transactions. Side effects: file I/O and collectives (DCP).

Layout of `{output_dir}/checkpoints/step_N/`: the DCP files of the model and optimizer
(`.metadata`, `__*_*.distcp`; of a LoRA model only the adapters and what else trains, not the
frozen base), `progress.json` (Progress, with the data position), `meta.json` (the model
directory, for export; with LoRA also the adapters' settings and the base's fingerprint,
fnt.model.lora.base_fingerprint), `config.json` (the resolved config the checkpoint was written
with, which a resume reconciles with its own: fnt.resume.reconcile_config), `components/NAME.pt`
(the state of each source handle that has one, fnt.state.Component: e.g. the policies an async
rollout engine still samples from), `checksums.json` (the size and xxh3-128 digest of every
other file, fnt.store.checksums) and the marker `COMPLETE`.

How completeness is marked (fnt.store.transaction): every rank writes into `step_N.partial/`; after
a barrier, each rank hashes its share of the shards, rank 0 writes `progress.json`, `meta.json`,
`config.json` and `components/`, hashes them, writes `checksums.json`, fsyncs everything, writes
`COMPLETE`, renames the directory to `step_N` and fsyncs the parent. `resolve_resume_step`
counts only directories named `step_N` that hold `COMPLETE`, so a crash at any moment of a save
leaves the previous checkpoint as the newest complete one. The learning rate is derived from
the step, so there is no scheduler state.

A run that starts at step N first moves newer complete checkpoints and unfinished saves into
`abandoned/<UTC time>/` (fnt.store.rundir.abandon_newer_), so the new trajectory never meets the old
one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import warnings
from functools import partial as bind
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from fnt.config import Config, to_json
from fnt.distributed.collectives import all_gather_objects
from fnt.errors import CheckpointError
from fnt.faults import fault_point
from fnt.model.lora import base_fingerprint, is_adapted, lora_of
from fnt.state import Progress
from fnt.store.checksums import (
    checkpoint_files,
    digests,
    rank_share,
    share_problems,
    write_checksums_,
)
from fnt.store.rundir import (
    COMPLETE_MARKER,
    COMPONENTS_DIR,
    CONFIG_FILE,
    META_FILE,
    PROGRESS_FILE,
    step_dir,
)
from fnt.store.transaction import begin_dir_, commit_dir_, is_complete, partial_dir, write_synced_


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
    with full_disk_named(final):
        if rank == 0:
            begin_dir_(final)
        _barrier(distributed)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=held_state(model))
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
        # Hashed now, while the shards are in the page cache: each rank hashes a share.
        world_size = dist.get_world_size() if distributed else 1
        shards = rank_share(checkpoint_files(partial), rank, world_size)
        shard_digests = all_gather_objects(digests(partial, shards), distributed)
        if rank == 0:
            write_synced_(partial / PROGRESS_FILE, progress.to_json(sort_keys=True))
            write_synced_(partial / META_FILE, json.dumps(checkpoint_meta(model, model_name)))
            if config is not None:
                write_synced_(partial / CONFIG_FILE, to_json(config) + "\n")
            for name, state in components.items():
                if state:
                    (partial / COMPONENTS_DIR).mkdir(exist_ok=True)
                    torch.save(dict(state), partial / COMPONENTS_DIR / f"{name}.pt")
            recorded = {name: d for share in shard_digests for name, d in share.items()}
            rest = [name for name in checkpoint_files(partial) if name not in recorded]
            write_checksums_(partial, {**recorded, **digests(partial, rest)})
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


# Below this much free space, a failed save is taken for a full disk whatever the error says
# (torch's zip writer reports a short write as "unexpected pos", without the errno).
LOW_DISK_BYTES = 16 << 20


@contextlib.contextmanager
def full_disk_named(final: Path) -> Iterator[None]:
    """Inside the block, a failure that a full disk caused becomes the CheckpointError of
    `disk_full_error`; any other passes as it is."""
    try:
        yield
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        full = disk_full_error(exc, final)
        if full is None:
            raise
        raise full from exc


def disk_full_error(exc: BaseException, final: Path) -> Optional[CheckpointError]:
    """The error to raise for a save of `final` that failed because its disk is full, naming
    ENOSPC, the directory and the free space; None when the disk is not full."""
    causes = exception_chain(exc)
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    no_space = any(getattr(c, "errno", None) == errno.ENOSPC for c in causes)
    if not no_space and (free is None or free >= LOW_DISK_BYTES):
        return None
    room = "" if free is None else f", {free / 2**20:.1f} MiB free"
    first = causes[-1]  # where it started: DCP's own exception is a whole traceback per rank
    return CheckpointError(
        f"saving checkpoint {final.name} failed: no space left on device (ENOSPC) in "
        f"{final.parent}{room}. Free space (or lower ckpt.keep_last) and resume: the newest "
        f"complete checkpoint is unchanged. ({type(first).__name__}: {first})"
    )


def exception_chain(exc: BaseException) -> list[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures a DCP CheckpointException
    holds, outermost first."""
    chain, pending = [], [exc]
    while pending:
        cause = pending.pop(0)
        chain.append(cause)
        pending += [c for c in (cause.__cause__, cause.__context__) if c is not None]
        if isinstance(cause, CheckpointException):
            pending += [failure for failure, _ in cause.failures.values()]
    return chain


def checkpoint_problems(path: Path, distributed: bool) -> list[str]:
    """Every file of a checkpoint that fails its recorded checksum, one line each (empty: it
    verifies, or it records no checksums). A collective under torchrun: each rank reads a share
    of the files, and every rank gets the whole list."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    shares = all_gather_objects(share_problems(path, rank, world_size), distributed)
    return [problem for share in shares for problem in share]


def load_checkpoint_(path: Path, model: Any, optimizer: Any, *, distributed: bool) -> Progress:
    """Load model and optimizer state in place from a complete checkpoint; return its Progress.

    A checkpoint that cannot be read is a CheckpointError naming it (with ckpt.verify on, the
    start checks its checksums first, so this is a damage no checksum records)."""
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} file)")
    options = held_state(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process"
            )
            dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
        progress = read_progress(path)
    except (Exception, CheckpointException) as exc:  # DCP's name neither checkpoint nor file
        first = exception_chain(exc)[-1]
        reason = str(first).split(". ")[0]  # torch's zip reader appends a paragraph of advice
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(first).__name__}: {reason}); resume from "
            "another step, or with ckpt.verify = true to find the damaged file"
        ) from exc
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    return progress


def held_state(model: Any) -> StateDictOptions:
    """What a checkpoint holds of `model`: every parameter; or, when some are frozen (the base
    of a LoRA model), only the trained ones, since the base is read from its own directory at
    every start (meta.json records its fingerprint, which a resume checks)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def checkpoint_meta(model: Any, model_name: str) -> dict[str, Any]:
    """meta.json: the model directory and, for a LoRA model, the base's fingerprint and the
    adapters' settings (what an export needs to rebuild the model)."""
    meta: dict[str, Any] = {"model_name": os.path.abspath(model_name)}
    if is_adapted(model):
        meta["base_fingerprint"] = base_fingerprint(model_name)
        meta["lora"] = dataclasses.asdict(lora_of(model))
    return meta


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
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
