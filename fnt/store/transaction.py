"""Directories written as transactions. Side effects: file I/O (writes, fsync, rename, delete).

Checkpoints, published weights and rollout directories are all written the same way, so a
reader never sees half of one:

1. `begin_dir_(final)` gives the sibling `final.partial/` (empty: a stale one left by a crash is
   removed) to write everything into;
2. `commit_dir_(partial, final)` fsyncs every file in it, writes the marker file `COMPLETE` last
   (fsynced), fsyncs the directory, renames it to `final` and fsyncs the parent.

A directory counts as complete only when it has its final name and holds `COMPLETE`, so a crash
at any moment leaves either the complete directory or one that readers ignore.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

# The names that mark a directory's state: committed (it holds COMPLETE), or being written
# (its name ends in .partial). Every reader of a run directory (fnt.store.rundir) uses these.
COMPLETE_MARKER = "COMPLETE"
PARTIAL_SUFFIX = ".partial"


def is_complete(path: Path) -> bool:
    """Whether `path` is a committed directory (it holds the marker file)."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def partial_dir(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def begin_dir_(final: Path) -> Path:
    """Create an empty `final.partial/` (and the parents) to write the transaction into."""
    partial = partial_dir(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def write_synced_(path: Path, text: str) -> None:
    """Write a text file and fsync it."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    # Files first, then their directories, so every name points at durable contents.
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def commit_dir_(
    partial: Path,
    final: Path,
    marker_text: str = "",
    *,
    replace: bool = False,
    before_rename: Optional[Callable[[], None]] = None,
) -> Path:
    """Make `partial` durable, mark it complete and rename it to `final` (see the module doc).

    An existing `final` is an error unless `replace`: then it is first made incomplete (marker
    removed), deleted, and the new directory takes its place. `before_rename` runs between the
    marker and the rename (the crash tests kill the process there).
    """
    _fsync_tree(partial)
    write_synced_(partial / COMPLETE_MARKER, marker_text)
    fsync_dir(partial)
    if before_rename is not None:
        before_rename()
    if replace and final.exists():
        (final / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(final.parent)
    return final
