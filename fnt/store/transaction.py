"""Directories written as transactions. Side effects: file I/O (writes, fsync, rename, delete).

Checkpoints, published weights and rollout directories are all written the same way, so a
reader never sees half of one:

1. `begin_dir_(final)` gives the sibling `final.partial/` (empty: a stale one left by a crash is
   removed) to write everything into;
2. `commit_dir_(partial, final)` fsyncs every file in it, writes the marker file `COMPLETE` last
   (fsynced), fsyncs the directory, renames it to `final` and fsyncs the parent.

A directory counts as complete only when it has its final name and holds `COMPLETE`, so a crash
at any moment leaves either the complete directory or one that readers ignore.

The commands that write a directory for the user (`fnt export`, `fnt make-tiny-model`) write it
the same way, through `staged_dir_`, with a marker naming the command (`output_marker`): a
killed one leaves `OUT.partial/`, never a half-written OUT, and `written_by` recognizes what a
command wrote before, so it may replace that and nothing else (fnt.store.paths.check_output_dir).
A file (`fnt plot`'s PNG) is written beside its place and renamed over it (`staged_file_`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from fnt.errors import ConfigError, named

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


def output_marker(written_by: str, **details: Any) -> str:
    """The marker text of a directory a command wrote: JSON naming the command (`written_by`,
    such as "fnt export") and what it was asked for. Pure."""
    return json.dumps({"written_by": written_by, **details}, sort_keys=True)


def written_by(path: Path) -> Optional[str]:
    """The command that wrote directory `path` (its marker's `written_by`), or None when no
    command's marker is there (checkpoints' markers name none)."""
    try:
        marker = json.loads((Path(path) / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker.get("written_by") if isinstance(marker, dict) else None


@contextlib.contextmanager
def staged_dir_(final: Path, marker_text: str, key: str) -> Iterator[Path]:
    """Write the directory `final` whole or not at all, for the block: yields an empty
    `final.partial/` to write into (missing parents are created), and when the block ends
    normally commits it in place of `final` with `marker_text` in its marker, replacing what is
    there (the caller has checked that it may: fnt.store.paths.check_output_dir). When the block
    raises, the partial directory and the parents made for it are removed again; a kill leaves
    `final.partial/`, which the next write of `final` replaces.

    A symlink `final` is written through (its target is replaced). An OSError creating the
    partial directory (a place the system refuses, such as /proc, which os.access lets root
    "write") is a ConfigError naming `key`: the first write is the check the reads before it
    could not make."""
    final = Path(os.path.realpath(final))
    made = [parent for parent in final.parents if not parent.exists()]
    try:
        partial = begin_dir_(final)
    except OSError as exc:
        _remove_empty_dirs_(made)
        raise ConfigError(
            f"{named(key, final)}: cannot create {partial_dir(final)}: {exc.strerror or exc}"
        ) from None
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        _remove_empty_dirs_(made)
        raise
    commit_dir_(partial, final, marker_text, replace=True)


def _remove_empty_dirs_(dirs: list[Path]) -> None:
    """Remove the directories of `dirs` (deepest first, as Path.parents lists them) that are
    empty; others stay."""
    for path in dirs:
        with contextlib.suppress(OSError):
            path.rmdir()


@contextlib.contextmanager
def staged_file_(final: Path, key: str) -> Iterator[Path]:
    """Write the file `final` whole or not at all, for the block: yields the path
    `final.partial` beside it to write to; when the block ends normally it is renamed over
    `final`, when the block raises it is removed. An OSError creating it is a ConfigError
    naming `key` (as in `staged_dir_`)."""
    final = Path(final)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    try:
        partial.open("wb").close()
    except OSError as exc:
        raise ConfigError(
            f"{named(key, final)}: cannot create {partial}: {exc.strerror or exc}"
        ) from None
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
