"""The run directory: every file and folder name fnt writes under `output_dir`, the rule for step
directories, their pruning, and the run's lock. Pure, except listing, pruning and moving step
directories (`list_step_dirs`, `prune_steps_`, `abandon_newer_`, `move_aside_`,
`prune_abandoned_`), reading metrics_missing.json (`read_missing_steps`), telling a run directory
by its entries and config (`run_entries`, `is_run_config`) and the lock (which removes what a
failed start created: fnt.store.failed_start). Imports
nothing heavy, so the command line, preflight and `fnt inspect` use it before (or without) torch.

```
{output_dir}/
  config.json            the resolved config (rank 0, rewritten at every start)
  metrics.jsonl          one strict-JSON row per step
  metrics_missing.json   the steps whose row a resume found unreadable (only when there are)
  wandb_run_id           the W&B run this directory logs to, when W&B is on
  wandb_logged           the last step W&B took (a resume sends it the rows it lacks)
  run.lock               held (flock) by the run using the directory
  data_cache/            tokenized data sources, reused by a resume (unless data.cache_dir)
  checkpoints/step_N/    complete checkpoints; step_N.partial/ while one is written
      progress.json  meta.json  config.json  components/  DCP shards  checksums.json
      COMPLETE
  checkpoints/abandoned/<UTC time>/   what a fork, an unfinished save or a failed check moved
                         aside (the newest ABANDONED_KEEP are kept)
  weights/step_N/        external RL: the published policy (a Hugging Face directory)
  rollouts/step_N/       external RL: the orchestrator's samples.jsonl (and policy_step)
  samples/step_N.jsonl   RL: step N's samples as text, on sample steps (fnt.store.samples)
```

A step directory counts only when it is named exactly `step_N` (no leading zeros, ASCII digits)
and holds the `COMPLETE` marker, which fnt.store.transaction writes last before renaming
`step_N.partial` into place; a crash at any moment therefore leaves a complete directory or one
that these rules ignore.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Collection, Iterable, Iterator, Optional, Union

from fnt.errors import ConfigError, named
from fnt.faults import fault_point
from fnt.store.failed_start import StartRecord, record_start, undo_start_
from fnt.store.transaction import COMPLETE_MARKER, PARTIAL_SUFFIX, fsync_dir

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
METRICS_MISSING_FILE = "metrics_missing.json"
WANDB_ID_FILE = "wandb_run_id"
WANDB_LOGGED_FILE = "wandb_logged"
DATA_CACHE_DIR = "data_cache"
LOCK_FILE = "run.lock"
CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
ROLLOUTS_DIR = "rollouts"
SAMPLES_DIR = "samples"
ABANDONED_DIR = "abandoned"
# Inside a checkpoint (besides CONFIG_FILE and the DCP shards).
PROGRESS_FILE = "progress.json"
META_FILE = "meta.json"
CHECKSUMS_FILE = "checksums.json"
COMPONENTS_DIR = "components"
# Inside rollouts/step_N.
SAMPLES_FILE = "samples.jsonl"
POLICY_STEP_FILE = "policy_step"

_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]*)")

# The entries of a run directory that only fnt writes: a directory holding any of them is a run
# directory. CONFIG_FILE is not among them, as a Hugging Face model directory has one too. Run
# directories of older versions have run.lock as well, since every run starts by taking the lock.
RUN_ENTRIES = (
    LOCK_FILE,
    METRICS_FILE,
    METRICS_MISSING_FILE,
    WANDB_ID_FILE,
    WANDB_LOGGED_FILE,
    DATA_CACHE_DIR,
    CHECKPOINTS_DIR,
    WEIGHTS_DIR,
    ROLLOUTS_DIR,
)
# The keys of a run's resolved config (config.json) that tell it from other config.json files.
RUN_CONFIG_KEYS = ("output_dir", "model", "max_steps")

PathLike = Union[str, Path]


def ckpt_root(output_dir: PathLike) -> Path:
    """The directory that holds a run's checkpoints."""
    return Path(output_dir) / CHECKPOINTS_DIR


def step_name(step: int) -> str:
    """The name of step N's directory: `step_N`."""
    return f"step_{step}"


def step_dir(root: PathLike, step: int) -> Path:
    """`root/step_N`: a checkpoint, published weights or a step's rollouts."""
    return Path(root) / step_name(step)


def step_of(name: str) -> Optional[int]:
    """N for a directory name `step_N`, else None."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def partial_step_of(name: str) -> Optional[int]:
    """N for `step_N.partial` (a transaction that never finished), else None."""
    return step_of(name[: -len(PARTIAL_SUFFIX)]) if name.endswith(PARTIAL_SUFFIX) else None


def step_ranges(steps: Collection[int]) -> str:
    """`1..3, 5, 7..8` for steps 1, 2, 3, 5, 7, 8. Pure."""
    ordered, parts = sorted(steps), []
    start = previous = None
    for step in [*ordered, None]:
        if previous is not None and step == previous + 1:
            previous = step
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}..{previous}")
        start = previous = step
    return ", ".join(parts)


def run_entries(path: PathLike) -> list[str]:
    """The RUN_ENTRIES that directory `path` holds, in RUN_ENTRIES' order (none when `path` is
    not a directory): a directory with any of them is a run directory."""
    path = Path(path)
    if not path.is_dir():
        return []
    return [name for name in RUN_ENTRIES if os.path.lexists(path / name)]


def is_run_config(path: PathLike) -> bool:
    """Whether the file at `path` is a run's resolved config (what a run writes as config.json),
    not another program's config.json (a Hugging Face model's, say)."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(key in config for key in RUN_CONFIG_KEYS)


def read_missing_steps(path: Path) -> tuple[list[int], Optional[str]]:
    """The steps a metrics_missing.json records as having no row (none without the file), and
    a line saying what is wrong with a file that is there but cannot be read (then no steps:
    the safe default, since the repair at the next start records again every step that
    metrics.jsonl lacks)."""
    if not path.exists():
        return [], None
    try:
        steps = json.loads(path.read_text(encoding="utf-8"))["missing_steps"]
        if not isinstance(steps, list) or not all(
            type(step) is int and step >= 1 for step in steps
        ):
            raise ValueError("'missing_steps' is not a list of steps")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON and UTF-8 errors too
        reason = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        return [], f"{path}: unreadable ({reason}); ignored"
    return sorted(steps), None


def list_step_dirs(root: PathLike) -> list[tuple[str, bool]]:
    """`(name, has_marker)` for each entry of root; empty if it does not exist."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [
        (entry.name, entry.is_dir() and os.path.isfile(os.path.join(entry.path, COMPLETE_MARKER)))
        for entry in os.scandir(root)
    ]


def complete_steps(entries: Iterable[tuple[str, bool]]) -> list[int]:
    """Sorted steps of the complete directories in a listing of `(name, has_marker)`. Pure."""
    return sorted(
        step for name, has_marker in entries if has_marker and (step := step_of(name)) is not None
    )


def run_steps(entries: Iterable[tuple[str, bool]]) -> list[int]:
    """Sorted steps of every `step_N` and `step_N.partial` in a listing, complete or not: what a
    run leaves in a step-numbered directory (weights/, rollouts/). Pure."""
    return sorted(
        step
        for name, _ in entries
        if (step := step_of(name)) is not None or (step := partial_step_of(name)) is not None
    )


def abandoned_names(entries: Iterable[tuple[str, bool]], start_step: int) -> list[str]:
    """The entries of a listing that a run starting at `start_step` moves aside: complete step
    directories newer than the start (another trajectory: resuming would collide with them,
    keep_last would count them as the newest, and "latest" would pick them later) and every
    `step_M.partial` (a save that never finished). Pure."""
    return sorted(
        name
        for name, has_marker in entries
        if (has_marker and (step := step_of(name)) is not None and step > start_step)
        or partial_step_of(name) is not None
    )


def steps_to_delete(steps: list[int], keep_last: int, keep: Collection[int] = ()) -> list[int]:
    """Complete steps beyond the newest `keep_last` (0 keeps all), except those in `keep` (the
    best checkpoint); never the newest one. Pure."""
    if keep_last <= 0:
        return []
    ordered = sorted(steps)
    return [step for step in ordered[: max(0, len(ordered) - keep_last)] if step not in keep]


def prune_steps_(root: PathLike, keep_last: int, keep: Collection[int] = ()) -> list[int]:
    """Delete the complete step directories beyond the newest `keep_last` but those in `keep`,
    and `step_N` directories without the marker; returns the deleted steps.

    Only a delete leaves a `step_N` without its marker (the marker goes first, so a crash
    mid-delete leaves a directory that readers ignore); removing those finishes the delete.
    Other names (`step_N.partial`, `abandoned/`, whatever fnt did not write) are never touched.
    """
    entries = list_step_dirs(root)
    leftovers = [
        step
        for name, has_marker in entries
        if not has_marker and (step := step_of(name)) is not None and step_dir(root, step).is_dir()
    ]
    doomed = steps_to_delete(complete_steps(entries), keep_last, keep)
    for step in doomed:
        path = step_dir(root, step)
        (path / COMPLETE_MARKER).unlink()
        fault_point("cleanup", step)
        shutil.rmtree(path)
    for step in leftovers:
        shutil.rmtree(step_dir(root, step))
    return sorted(doomed + leftovers)


def abandon_newer_(root: PathLike, start_step: int) -> list[tuple[Path, Path]]:
    """Move what `abandoned_names` picks aside (`move_aside_`); returns the `(from, to)` pairs."""
    return move_aside_(root, abandoned_names(list_step_dirs(root), start_step))


def move_aside_(root: PathLike, names: list[str]) -> list[tuple[Path, Path]]:
    """Move the named entries of root into `abandoned/<UTC time>/`, kept as they were; returns
    the `(from, to)` pairs. Each move is one rename, so a crash in between leaves the rest where
    they were (a start moves them again)."""
    if not names:
        return []
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    target = Path(root) / ABANDONED_DIR / stamp
    target.mkdir(parents=True)
    moves = [(Path(root) / name, target / name) for name in names]
    for source, destination in moves:
        os.replace(source, destination)
    fsync_dir(target)
    fsync_dir(Path(root))
    return moves


# How many of the newest `abandoned/<UTC time>/` folders a start keeps: enough to look into what
# the last few forks, interrupted saves and damaged checkpoints left, without filling the disk.
ABANDONED_KEEP = 3


def prune_abandoned_(root: PathLike, keep: int = ABANDONED_KEEP) -> list[Path]:
    """Delete all but the newest `keep` folders of `root/abandoned/`; returns the deleted ones.
    Their names are UTC times, so they sort by age."""
    folder = Path(root) / ABANDONED_DIR
    if not folder.is_dir():
        return []
    doomed = sorted(p for p in folder.iterdir() if p.is_dir())[: -keep or None]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# ---------------------------------------------------------------------------------------------
# One run per directory


def make_output_dir_(output_dir: PathLike) -> Path:
    """Create `output_dir` and its parents, as a user means them: a symlink whose target does
    not exist yet creates the target (the link stays); a path that is a file, or that cannot be
    created, is a ConfigError naming it."""
    path = Path(output_dir)
    here = named("output_dir", path)
    if path.is_symlink() and not path.exists():
        target = Path(os.path.realpath(path))
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{here}: is a symlink to {str(target)!r}, which cannot be created: {exc.strerror}"
            ) from None
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{here}: is a file, not a directory: choose another output_dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{here}: cannot be created: {exc.strerror}") from None
    return path


def lock_output_dir_(output_dir: PathLike) -> IO[str]:
    """Take the run's exclusive lock on `output_dir`, or raise ConfigError naming its holder.

    Two runs on one directory would interleave their rows and checkpoints. The lock is an OS
    `flock`, so it is released when its holder dies, however it dies: a stale lock file never
    blocks. The holder's host and pid are written inside, for the message. Close the returned
    file to release it.
    """
    output_dir = make_output_dir_(output_dir)
    path = output_dir / LOCK_FILE
    # Opened without truncating: while another run holds the lock, its text must stay readable.
    lock = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a run that has not written its host and pid yet"
        lock.close()
        raise ConfigError(
            f"output_dir {str(output_dir)!r} is in use by another run ({holder}; lock {path}): "
            "wait for it to end, stop it, or choose another output_dir"
        ) from None
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    lock.flush()
    return lock


# The locks this process holds, by directory: `run_lock` nests, so the command line can take the
# lock before its heavy imports and the driver's own `run_lock` then finds it held. Beside each,
# what the directory held before (fnt.store.failed_start), undone if the start fails.
_HELD: dict[str, IO[str]] = {}
_STARTS: dict[str, StartRecord] = {}


@contextlib.contextmanager
def run_lock(output_dir: PathLike) -> Iterator[None]:
    """Hold the lock of `output_dir` (`lock_output_dir_`) for the block; inside a block of this
    process that already holds it, do nothing. An exception out of the block before the run's
    first row undoes what the start created in the directory (fnt.store.failed_start:
    `start_changing`, `start_done`), still under the lock."""
    key = os.path.realpath(output_dir)
    if key in _HELD:
        yield
        return
    own = (*RUN_ENTRIES, CONFIG_FILE, SAMPLES_DIR)
    record = record_start(output_dir, LOCK_FILE, own, keep=(ROLLOUTS_DIR,))
    _HELD[key] = lock_output_dir_(output_dir)
    _STARTS[key] = record
    try:
        yield
    except BaseException:
        try:
            undo_start_(record)
        except OSError:  # best effort: the failure that ended the start is what to report
            pass
        raise
    finally:
        del _STARTS[key]
        _HELD.pop(key).close()


def start_changing(output_dir: PathLike) -> None:
    """Note that the start now changes what `output_dir` held (moves, rewrites, prunes): a
    failure from here leaves a directory that held anything as it is. No lock held: nothing."""
    record = _STARTS.get(os.path.realpath(output_dir))
    if record is not None:
        record.changing = True


def start_done(output_dir: PathLike) -> None:
    """Note that the run's first row is written: a failure from here is the run's, not its
    start's, and nothing is undone. No lock held: nothing."""
    record = _STARTS.get(os.path.realpath(output_dir))
    if record is not None:
        record.done = True


def rank0_run_lock(output_dir: PathLike) -> contextlib.AbstractContextManager:
    """`run_lock(output_dir)` on rank 0 (or in a process torchrun did not start), nothing on
    the other ranks: they need no lock of their own, since torchrun stops them when rank 0
    fails. The rank is read from the environment, so this works before any process group."""
    if os.environ.get("RANK", "0") == "0":
        return run_lock(output_dir)
    return contextlib.nullcontext()
