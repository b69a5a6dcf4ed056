"""The rules of the paths commands read and write: what must exist, be a checkpoint, be writable
or be free to write. Side effects: reads files and directories. Every command's up-front checks
(fnt.apps.preflight) and the writers themselves use them.

Each rule raises one ConfigError (a CheckpointError for a checkpoint; `error` where the caller
says, DataError for data) whose message names the key, option or argument and the path
(fnt.errors.named):
- `require_file`, `require_dir`: the path exists and is of that kind;
- `require_checkpoint`: a complete checkpoint directory (a run directory is named as one, with
  its checkpoints);
- `require_writable_place`: the path exists writable, or can be created;
- `check_output_dir`: a directory a command writes whole (fnt.store.transaction.staged_dir_) is
  absent, empty, what the same command wrote before, or replaced with `force`; never a run
  directory, a directory inside one's checkpoints or weights, or one holding what is read;
- `check_output_file`: likewise for a file a command writes (`written_by_png` recognizes it);
- `require_run_output_dir`: a run's output_dir holds no one else's file at a name the run
  writes (config.json).
They read only: where the system refuses what os.access allows (root "may write" /proc), the
writer's own first write is the check, and it fails as one line too.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from fnt.errors import CheckpointError, ConfigError, named
from fnt.store.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    META_FILE,
    RUN_CONFIG_KEYS,
    RUN_ENTRIES,
    ckpt_root,
    complete_steps,
    is_run_config,
    list_step_dirs,
    run_entries,
    step_name,
)
from fnt.store.transaction import PARTIAL_SUFFIX, is_complete, written_by

PathLike = Union[str, Path]

# The names of the commands that write outputs, as their markers say (output_marker's
# written_by, a PNG's Software text).
EXPORT = "fnt export"
TINY_MODEL = "fnt make-tiny-model"
PLOT = "fnt plot"
# How many of a directory's entries a message lists.
LISTED_ENTRIES = 5


def require_file(path: PathLike, key: str, error: type = ConfigError) -> None:
    """`error` unless `path` is an existing file (or a link to one)."""
    if not os.path.exists(path):
        raise error(f"{named(key, path)}: no such file")
    if os.path.isdir(path):
        raise error(f"{named(key, path)}: is a directory, expected a file")


def require_dir(path: PathLike, key: str, error: type = ConfigError, expected: str = "") -> None:
    """`error` unless `path` is an existing directory (or a link to one); `expected` says what
    kind of directory, for the message."""
    wanted = f"expected {expected or 'a directory'}"
    if not os.path.exists(path):
        raise error(f"{named(key, path)}: no such directory ({wanted})")
    if not os.path.isdir(path):
        raise error(f"{named(key, path)}: is a file, {wanted}")


def require_checkpoint(path: PathLike, key: str) -> dict:
    """The meta.json of the complete checkpoint at `path`, or a CheckpointError saying what is
    there instead: nothing, a file, a run directory (with its complete checkpoints), a save that
    did not finish, a directory some command wrote, or something else."""
    path = Path(path)
    require_dir(path, key, CheckpointError, "a checkpoint directory, RUN/checkpoints/step_N")
    if run_entries(path):
        root, what = ckpt_root(path), "a run directory"
    elif path.name == CHECKPOINTS_DIR and run_entries(path.parent):
        root, what = path, "a run's checkpoints directory"
    else:
        root = None
    if root is not None:
        steps = complete_steps(list_step_dirs(root))
        which = (
            f"pass one of its complete checkpoints, such as {root / step_name(steps[-1])} "
            f"(steps {', '.join(map(str, steps))})"
            if steps
            else "it has no complete checkpoint"
        )
        raise CheckpointError(f"{named(key, path)}: is {what}, not a checkpoint: {which}")
    if not is_complete(path):
        why = (
            "a save that did not finish"
            if path.name.endswith(PARTIAL_SUFFIX)
            else "not a checkpoint, or one whose save did not finish"
        )
        raise CheckpointError(
            f"{named(key, path)}: is not a complete checkpoint (no COMPLETE file: {why})"
        )
    writer = written_by(path)
    if writer is not None:
        raise CheckpointError(f"{named(key, path)}: was written by {writer}, not a checkpoint")
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{named(key, path)}: is not a checkpoint fnt can read ({META_FILE}: "
            f"{getattr(exc, 'strerror', None) or exc})"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{named(key, path)}: its {META_FILE} is not a JSON object")
    return meta


def require_writable_place(path: PathLike, key: str) -> None:
    """ConfigError unless `path` is a writable directory, or does not exist and its nearest
    existing ancestor is one (so it can be created). Reads only: where the system refuses what
    os.access allows (root "may write" /proc), the writer's own first write is the check, and it
    fails as one line too (fnt.transaction.staged_dir_, fnt.rundir.make_output_dir_)."""
    target = Path(os.path.realpath(path))
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"{named(key, path)}: cannot be created, as {existing} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{named(key, path)}: {existing} is not writable")


def check_output_dir(
    path: PathLike,
    key: str,
    written_by_: str,
    *,
    force: bool,
    keep: Sequence[PathLike] = (),
) -> None:
    """ConfigError unless the command `written_by_` (e.g. "fnt export") may write the directory
    `path` whole (fnt.transaction.staged_dir_): it is absent or empty, or that command wrote it
    before (its marker says so), or `force` asks to replace it. Never, even with `force`: a run
    directory, a directory inside a run's checkpoints/, weights/ or other entries, a directory
    holding a run directory at its top or holding (or inside) a path of `keep` (what the command
    reads, such as the checkpoint being exported). Its parent must be writable."""
    target = Path(os.path.realpath(path))
    here = named(key, path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{here}: is a file, expected a directory to write (new or empty)")
    entries = run_entries(target)
    if entries:
        raise ConfigError(
            f"{here}: is a run directory (it holds {', '.join(entries)}); {written_by_} never "
            f"writes into one: choose another path"
        )
    for parent in target.parents:
        inside = target.relative_to(parent).parts[0]
        if inside in RUN_ENTRIES and run_entries(parent):
            raise ConfigError(
                f"{here}: is inside the run directory {parent}'s {inside}; {written_by_} never "
                "writes there: choose a path outside it"
            )
    for kept in map(lambda p: Path(os.path.realpath(p)), keep):
        if kept == target or target in kept.parents or kept in target.parents:
            raise ConfigError(
                f"{here}: holds or lies inside {kept}, which {written_by_} reads: choose "
                "another path"
            )
    require_writable_place(target.parent, key)
    if not target.is_dir():
        return
    names = sorted(os.listdir(target))
    if not names or written_by(target) == written_by_:
        return
    runs = [name for name in names if run_entries(target / name)]
    if runs:
        raise ConfigError(
            f"{here}: holds the run directory {target / runs[0]}; {written_by_} never replaces "
            "it: choose another path"
        )
    if not force:
        raise ConfigError(
            f"{here}: is not empty and {written_by_} did not write it (it holds "
            f"{listing(names)}): choose a new or empty directory, or pass --force to replace it"
        )
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"{here}: is not writable, so --force cannot replace it")


def check_output_file(path: PathLike, key: str, written_by_: str, *, force: bool) -> None:
    """ConfigError unless the command `written_by_` may write the file `path`: its directory
    exists and is writable, and the file is absent, one that command wrote before (a PNG it
    signed: `written_by_png`), or replaced with `force`."""
    target = Path(path)
    here = named(key, path)
    if target.is_dir():
        raise ConfigError(f"{here}: is a directory, expected a file to write")
    if not target.parent.is_dir():
        raise ConfigError(f"{here}: directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{here}: directory {target.parent} is not writable")
    if target.exists() and not force and written_by_png(target) != written_by_:
        raise ConfigError(
            f"{here}: exists and {written_by_} did not write it: choose another path, or pass "
            "--force to replace it"
        )


def written_by_png(path: PathLike) -> Optional[str]:
    """The `Software` text of the PNG file at `path` (the program that wrote it), or None when
    it is not a PNG or has none. Reads the file's chunks up to the image data."""
    try:
        with open(path, "rb") as fh:
            if fh.read(8) != b"\x89PNG\r\n\x1a\n":
                return None
            while True:
                header = fh.read(8)
                if len(header) < 8:
                    return None
                length, kind = struct.unpack(">I4s", header)
                if kind in (b"IDAT", b"IEND"):  # text chunks that matter come first
                    return None
                data = fh.read(length)
                fh.read(4)  # the chunk's CRC
                if kind == b"tEXt":
                    name, _, text = data.partition(b"\0")
                    if name == b"Software":
                        return text.decode("latin-1")
    except OSError:
        return None


def require_run_output_dir(output_dir: PathLike, key: str = "output_dir") -> None:
    """ConfigError unless a run may write into `output_dir`: it is absent (and can be created)
    or a directory in which no file the run writes is someone else's. The run writes only its
    own names (fnt.store.rundir), so other files stay as they are (a log the shell or the scheduler
    opened there before the run started, say); the one such name other programs use is
    config.json, which a model directory or another trainer's output has and a run would
    replace."""
    here = named(key, output_dir)
    path = Path(output_dir)
    if os.path.exists(path) and not path.is_dir():
        raise ConfigError(f"{here}: is a file, not a directory: choose another {key}")
    require_writable_place(path, key)
    config = path / CONFIG_FILE
    if config.exists() and not is_run_config(config):
        names = sorted(os.listdir(path))
        raise ConfigError(
            f"{here}: its {CONFIG_FILE} is not a run's config (no keys "
            f"{', '.join(RUN_CONFIG_KEYS)}), and a run would replace it; the directory holds "
            f"{listing(names)}, a model's or another program's: choose a new {key}"
        )


def listing(names: Sequence[str]) -> str:
    """`a, b, c and 4 more`: the first LISTED_ENTRIES names. Pure."""
    shown = ", ".join(names[:LISTED_ENTRIES])
    more = len(names) - LISTED_ENTRIES
    return f"{shown} and {more} more" if more > 0 else shown
