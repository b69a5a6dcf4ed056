"""Checksums of the files in a checkpoint, and their verification. Side effects: reads files.

A checkpoint's `checksums.json` maps the relative path of every file it holds (but the marker
and itself) to its size and xxh3-128 digest. The saver hashes the files right after writing
them (they are still in the page cache: xxh3 over a memory map runs at ~14 GB/s on one core)
and writes the record before the marker, so a committed checkpoint always carries one. A disk
that flips a bit, a copy cut short or a block overwritten later is then found before anything
is loaded (fnt.checkpoint.checkpoint_problems), and named with its file.

Work is split over the ranks by file (`rank_share`): each rank hashes or verifies every
world-th file of the sorted list.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Mapping, Sequence

import xxhash

from fnt.store.rundir import CHECKSUMS_FILE
from fnt.store.transaction import COMPLETE_MARKER, write_synced_

HASH = "xxh3_128"

Digest = dict[str, object]  # {"bytes": int, HASH: hex str}


def file_digest(path: Path) -> Digest:
    """The size and xxh3-128 digest of one file, hashed through a read-only memory map: no copy
    out of the page cache (3x faster than reading it in chunks), and a shard of several GB
    never sits in this process's memory."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size:  # an empty file cannot be mapped
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                hasher.update(mapped)
    return {"bytes": size, HASH: hasher.hexdigest()}


def checkpoint_files(directory: Path) -> list[str]:
    """Sorted relative paths (with `/`) of the files a checkpoint's checksums cover: all but the
    marker and the checksums file itself."""
    directory = Path(directory)
    return sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.name not in (COMPLETE_MARKER, CHECKSUMS_FILE)
    )


def rank_share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The files rank `rank` of `world_size` hashes or verifies: every world-th one. Pure."""
    return list(names[rank::world_size])


def digests(directory: Path, names: Sequence[str]) -> dict[str, Digest]:
    """`{name: digest}` of the named files under `directory`."""
    return {name: file_digest(Path(directory) / name) for name in names}


def write_checksums_(directory: Path, recorded: Mapping[str, Digest]) -> None:
    """Write `checksums.json` (fsynced) into a checkpoint being written."""
    text = json.dumps({"hash": HASH, "files": dict(sorted(recorded.items()))}, indent=1)
    write_synced_(Path(directory) / CHECKSUMS_FILE, text + "\n")


class NoChecksums(Exception):
    """The checkpoint records no checksums (an older fnt wrote it)."""


def read_checksums(directory: Path) -> dict[str, Digest]:
    """The recorded `{name: digest}`; NoChecksums when the file is absent, ValueError naming it
    when it cannot be read."""
    path = Path(directory) / CHECKSUMS_FILE
    if not path.is_file():
        raise NoChecksums(str(path))
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        files = record["files"]
        if record.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"expected {HASH} digests")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: unreadable checksums ({exc})") from None
    return files


def file_problem(directory: Path, name: str, expected: Mapping[str, object]) -> str | None:
    """What is wrong with one recorded file (missing, another size, other contents), or None."""
    path = Path(directory) / name
    if not path.is_file():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != expected.get("bytes"):
        return f"{path}: {size} bytes, {expected.get('bytes')} recorded (truncated or overwritten)"
    if file_digest(path)[HASH] != expected.get(HASH):
        return f"{path}: contents differ from its recorded checksum (damaged on disk)"
    return None


def share_problems(directory: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share of the verification of a checkpoint: one line per bad file (or one for
    unreadable checksums). A checkpoint without checksums has none to find."""
    try:
        recorded = read_checksums(directory)
    except NoChecksums:
        return []
    except ValueError as exc:
        return [str(exc)] if rank == 0 else []
    return [
        problem
        for name in rank_share(sorted(recorded), rank, world_size)
        if (problem := file_problem(directory, name, recorded[name])) is not None
    ]
