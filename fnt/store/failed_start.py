"""A start that fails leaves the output directory as it found it. Side effects: `record_start`
lists the output directory (every path under it) and reads its lock file; `undo_start_` removes
what the start created there and writes the lock file's text back.

A command that fails before its first step (a bad data line met while tokenizing, a model that
will not load, a step 1 that raises) should not leave `run.lock`, `data_cache/` or an empty
metrics.jsonl behind: a new directory is removed, with the parents the start created for it;
an existing one gets back exactly the entries it had. The run lock's holder owns the record
(fnt.store.rundir.run_lock takes it just before the lock, and undoes on an exception), and the
driver says how far the start got:

- `changing`: the start begins to change what was there (moves a checkpoint aside, rewrites
  config.json, prunes): from then on an existing directory that held anything is left as it
  is, since undoing would need the old files back; an empty or new one is still undone;
- `done`: the first step's row is written, or the start state's weights are published to the
  rollout engine (an orchestrator or inference server may be reading them): the run has begun,
  and nothing is undone.

Only names the run writes are removed from an existing directory (`own`; new entries beneath
them too), never another program's file that appeared meanwhile, and never `keep` (rollouts/,
which an external orchestrator writes) even from a directory the start created.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Optional, Union

PathLike = Union[str, Path]


@dataclass
class StartRecord:
    """What the output directory held when a start took its lock (mutable: the driver marks
    how far the start got)."""

    root: Path
    """The output directory, absolute."""
    created: Optional[Path]
    """The topmost directory on the way to `root` that did not exist (None: `root` existed)."""
    entries: frozenset[str]
    """The paths under `root` that existed, relative to it."""
    lock_name: str
    lock_text: Optional[bytes]
    """The lock file's bytes before the start wrote its host and pid (None: no lock file)."""
    own: frozenset[str]
    """The top-level names the run writes: the only new entries removed from an existing one."""
    keep: frozenset[str]
    """Top-level names never removed: what another process writes into the run directory."""
    changing: bool = False
    done: bool = False

    @property
    def held_nothing(self) -> bool:
        """Whether the directory was new, or held nothing but (at most) a lock file."""
        return self.entries <= {self.lock_name}

    @property
    def undoes(self) -> bool:
        """Whether a failure now is undone: the first row is not written, and what was there is
        unchanged or was nothing."""
        return not self.done and (not self.changing or self.held_nothing)


def record_start(
    output_dir: PathLike, lock_name: str, own: Collection[str], keep: Collection[str]
) -> StartRecord:
    """What `output_dir` holds now, before a start takes its lock there."""
    root = Path(os.path.abspath(output_dir))
    created = None
    for path in (root, *root.parents):
        if os.path.lexists(path):
            break
        created = path
    entries: set[str] = set()
    if created is None and root.is_dir():
        for dirpath, dirnames, filenames in os.walk(root):
            for name in (*dirnames, *filenames):
                entries.add(os.path.relpath(os.path.join(dirpath, name), root))
    lock = root / lock_name
    try:
        lock_text = lock.read_bytes() if lock.is_file() else None
    except OSError:
        lock_text = None
    return StartRecord(
        root, created, frozenset(entries), lock_name, lock_text, frozenset(own), frozenset(keep)
    )


def undo_start_(record: StartRecord) -> list[Path]:
    """Remove what the start created under `record.root` (`undoes` permitting), write the lock
    file's old text back, remove the directories the start created when they are empty; the
    removed paths. Call it holding the lock: removing the lock file is the last act."""
    if not record.undoes or not record.root.is_dir():
        return []
    removed = []
    lock = record.root / record.lock_name
    for dirpath, dirnames, filenames in os.walk(record.root):
        relative_dir = os.path.relpath(dirpath, record.root)
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            relative = name if relative_dir == "." else os.path.join(relative_dir, name)
            if relative in record.entries or path == lock:
                continue
            top = relative.split(os.sep, 1)[0]
            if top in record.keep or not (record.created or top in record.own):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        # Descend only into what stays (a removed directory is gone).
        dirnames[:] = [d for d in dirnames if (Path(dirpath) / d).is_dir()]
    if record.lock_text is not None:
        lock.write_bytes(record.lock_text)
    elif lock.exists():
        lock.unlink()
        removed.append(lock)
    if record.created is not None:
        for path in (record.root, *record.root.parents):
            if not path.is_dir() or os.listdir(path):
                break
            path.rmdir()
            removed.append(path)
            if path == record.created:
                break
    return removed
