"""Tokenize once: a cache of tokenized sources, shared by resumes and by other runs on the same
data, and the tokenization of a source split over the ranks. Side effects: reads the source
files (to hash them) and the tokenizer's files, reads, writes and removes files of the cache
directory, and gathers small values over the ranks under torchrun.

One file per source, `{cache_dir}/{key}.safetensors`. The key (`cache_key`) is an xxh3-128 hash
of everything the samples depend on: the source's description (path or dataset, columns), the
contents of its files (a dataset: its `datasets` fingerprint), the tokenizer (its files, its
special tokens, its size), the chat template, the loss mask settings, seq_len and
data.overlong. Any change makes another key, so a stale entry is never read; entries are
written to a temporary name and renamed, so a reader never sees half of one.

An entry is data only, never code: a safetensors file (which any safetensors reader opens) of
flat integer tensors, the few plain values (cut turns, a bad record's message) as a JSON text in
a uint8 tensor, and in its metadata the cache format and an xxh3-128 digest of every tensor's
name, dtype, shape and bytes (`entry_digest`). A read checks the format, the size and the digest
before it decodes anything (`read_entry`); a directory shared between runs (data.cache_dir) is
therefore read as data, and whoever can write it can spoil a cache entry, which is found and
rebuilt, but cannot run code in the processes that read it. Entries of fnt before this format
(`{key}.pt`, pickles) are never loaded: they are reported, removed and rebuilt.

A damaged entry (another digest, cut short, unreadable, another format) is reported in one line
naming the file and what is wrong, removed, and the source tokenized again. Under torchrun every
rank reads the entry and the ranks gather what each found, so all rebuild or none does.

On a miss every rank tokenizes every world-th record of the source (`tokenize_share`) and
writes its share next to the entry; after a gather each rank reads all shares and merges them
back into record order, rank 0 writes the entry and removes the shares. A rank keeps its own
share in memory and checks the others' files; a share that fails on any rank is reported and
tokenized again by every rank but its own (tokenizing is deterministic, so that is what the
share should have held). A bad record on any rank is reported by every rank alike (the first
in record order), so no rank waits for another.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import xxhash

from fnt.data.hub import load_hf_dataset
from fnt.errors import DataError
from fnt.store.checksums import file_digest

# The version of what `cache_key` hashes. Kept at 1 when the entries became safetensors files,
# so that an older fnt's pickled entry has the key of the entry that replaces it and is found.
KEY_VERSION = 1
# The format of an entry file, recorded in it: a reader refuses another (3: with the
# located notes of skipped bad chats, data.on_bad_sample; 4: and of empty assistant turns).
CACHE_FORMAT = 4
ENTRY_SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # the pickled entries of fnt before CACHE_FORMAT 2
HASH = "xxh3_128"
# The tokenizer's files in its directory that change how text becomes ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class SourceSamples:
    """A source's fitted samples back to back: what the cache holds for it."""

    ids: array = field(default_factory=lambda: array("q"))
    targets: array = field(default_factory=lambda: array("b"))
    lengths: list[int] = field(default_factory=list)
    fates: list[int] = field(default_factory=list)  # SampleFate values
    records: list[int] = field(default_factory=list)  # the record index of each sample
    trailing: list[tuple[int, str]] = field(default_factory=list)  # (record, location) cut
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (record, location, why)
    empty: list[tuple[int, str, str]] = field(default_factory=list)  # (record, location, turns)
    error: Optional[tuple[int, str]] = None  # (record, message) of the first bad record

    def add(self, record: int, ids, targets, fate: int) -> None:
        self.ids.extend(ids)
        self.targets.extend(targets)
        self.lengths.append(len(ids))
        self.fates.append(int(fate))
        self.records.append(record)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The samples as the flat arrays of an entry (views of the token arrays, no copy)."""
        plain = {
            "trailing": self.trailing,
            "skipped": self.skipped,
            "empty": self.empty,
            "error": self.error,
        }
        return {
            "ids": np.frombuffer(self.ids, dtype=np.int64),
            "targets": np.frombuffer(self.targets, dtype=np.int8),
            "lengths": np.array(self.lengths, dtype=np.int64),
            "fates": np.array(self.fates, dtype=np.int8),
            "records": np.array(self.records, dtype=np.int64),
            "plain": np.frombuffer(json.dumps(plain).encode(), dtype=np.uint8),
        }

    @staticmethod
    def from_arrays(arrays: dict[str, np.ndarray]) -> SourceSamples:
        """The samples of an entry's arrays; ValueError when they do not fit together."""
        plain = json.loads(arrays["plain"].tobytes().decode("utf-8"))
        samples = SourceSamples(
            lengths=arrays["lengths"].tolist(),
            fates=arrays["fates"].tolist(),
            records=arrays["records"].tolist(),
            trailing=[(int(r), str(where)) for r, where in plain["trailing"]],
            skipped=[(int(r), str(where), str(why)) for r, where, why in plain["skipped"]],
            empty=[(int(r), str(where), str(turns)) for r, where, turns in plain["empty"]],
            error=(int(plain["error"][0]), str(plain["error"][1])) if plain["error"] else None,
        )
        samples.ids.frombytes(memoryview(arrays["ids"]).cast("B"))
        samples.targets.frombytes(memoryview(arrays["targets"]).cast("B"))
        counts = {len(samples.lengths), len(samples.fates), len(samples.records)}
        tokens = {sum(samples.lengths), len(samples.ids), len(samples.targets)}
        if len(counts) != 1 or len(tokens) != 1:
            raise ValueError("its arrays do not fit together (samples, lengths and tokens)")
        return samples


# The arrays of an entry: name -> (numpy dtype, safetensors dtype).
ENTRY_ARRAYS = {
    "ids": (np.int64, "I64"),
    "targets": (np.int8, "I8"),
    "lengths": (np.int64, "I64"),
    "fates": (np.int8, "I8"),
    "records": (np.int64, "I64"),
    "plain": (np.uint8, "U8"),
}


def entry_digest(arrays: Iterable[tuple[str, str, list[int], Any]]) -> str:
    """The xxh3-128 digest of an entry's arrays, given as (name, safetensors dtype, shape,
    bytes), whatever their order: what its metadata records. The names, dtypes and shapes are
    hashed with the bytes, so a header that still parses after damage does not pass either.
    Pure."""
    hasher = xxhash.xxh3_128()
    for name, dtype, shape, data in sorted(arrays, key=lambda a: a[0]):
        hasher.update(json.dumps([name, dtype, list(shape)]).encode())
        hasher.update(data)
    return hasher.hexdigest()


def write_entry_(samples: SourceSamples, path: Path) -> None:
    """Write `samples` as an entry at `path`: to a temporary name, then renamed over it."""
    from safetensors.numpy import save

    arrays = samples.to_arrays()
    digest = entry_digest(
        (name, ENTRY_ARRAYS[name][1], list(a.shape), memoryview(a).cast("B"))
        for name, a in arrays.items()
    )
    data = save(arrays, metadata={"format": str(CACHE_FORMAT), HASH: digest})
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class EntryProblem(ValueError):
    """A cache entry that cannot be used; the message names the file and what is wrong."""


def read_entry(path: Path) -> SourceSamples:
    """The samples of the entry at `path`, once its format, size and digest check out
    (`verify_entry`); FileNotFoundError when there is none, EntryProblem (naming the file) for
    any other failure. Nothing is decoded before the digest matches."""
    data = path.read_bytes()  # FileNotFoundError passes: a miss, not a problem
    verify_entry(path, data)
    return decode_entry(path, data)


def verify_entry(path: Path, data: bytes) -> None:
    """EntryProblem naming `path` unless `data`, its bytes, are an entry of this format whose
    size and digest are the recorded ones. Pure."""
    if len(data) < 8:
        raise EntryProblem(f"{path}: {len(data)} bytes, not a cache entry (truncated)")
    size = int.from_bytes(data[:8], "little")
    if 8 + size > len(data):
        raise EntryProblem(
            f"{path}: {len(data)} bytes, shorter than its header says (truncated or damaged)"
        )
    try:
        header = json.loads(data[8 : 8 + size])
        meta = header.pop("__metadata__", None) or {}
        layout = {}
        for name, d in header.items():
            start, end = d["data_offsets"]
            layout[name] = (d["dtype"], list(d["shape"]), (int(start), int(end)))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EntryProblem(f"{path}: unreadable header ({exc}), not a cache entry") from None
    if meta.get("format") != str(CACHE_FORMAT):
        raise EntryProblem(
            f"{path}: written in cache format {meta.get('format')!r}; this fnt reads format "
            f"{CACHE_FORMAT}"
        )
    expected = 8 + size + max((end for _, _, (_, end) in layout.values()), default=0)
    if len(data) != expected:
        raise EntryProblem(
            f"{path}: {len(data)} bytes, {expected} recorded (truncated or overwritten)"
        )
    if set(layout) != set(ENTRY_ARRAYS):
        raise EntryProblem(f"{path}: holds arrays {sorted(layout)}, not a cache entry's")
    view = memoryview(data)[8 + size :]
    digest = entry_digest(
        (name, dtype, shape, view[start:end])
        for name, (dtype, shape, (start, end)) in layout.items()
    )
    if digest != meta.get(HASH):
        raise EntryProblem(f"{path}: contents differ from its recorded checksum (damaged on disk)")


def decode_entry(path: Path, data: bytes) -> SourceSamples:
    """The samples of a verified entry's bytes; EntryProblem naming `path` when they do not
    decode (what no digest can catch: an entry written wrong). Pure."""
    from safetensors.numpy import load

    try:
        arrays = load(data)
        for name, (dtype, _) in ENTRY_ARRAYS.items():
            if arrays[name].dtype != dtype or arrays[name].ndim != 1:
                raise ValueError(f"array {name!r} is {arrays[name].dtype} {arrays[name].shape}")
        return SourceSamples.from_arrays(arrays)
    except Exception as exc:  # safetensors' own errors, and what does not fit together
        raise EntryProblem(f"{path}: unreadable cache entry ({exc})") from None


def merge_shares(shares: list[SourceSamples]) -> SourceSamples:
    """The shares of the ranks as one source, in record order (each share holds every
    world-th record, in order). Pure."""
    merged = SourceSamples()
    errors = [share.error for share in shares if share.error is not None]
    merged.error = min(errors) if errors else None
    runs = []  # (record, share, first sample, sample count, token start)
    for index, share in enumerate(shares):
        start = 0
        i = 0
        while i < len(share.records):
            j = i
            tokens = 0
            while j < len(share.records) and share.records[j] == share.records[i]:
                tokens += share.lengths[j]
                j += 1
            runs.append((share.records[i], index, i, j - i, start))
            start += tokens
            i = j
    for record, index, first, count, start in sorted(runs):
        share = shares[index]
        tokens = sum(share.lengths[first : first + count])
        merged.ids.extend(share.ids[start : start + tokens])
        merged.targets.extend(share.targets[start : start + tokens])
        merged.lengths.extend(share.lengths[first : first + count])
        merged.fates.extend(share.fates[first : first + count])
        merged.records.extend([record] * count)
    merged.trailing = sorted(t for share in shares for t in share.trailing)
    merged.skipped = sorted(t for share in shares for t in share.skipped)
    merged.empty = sorted(t for share in shares for t in share.empty)
    return merged


def tokenizer_digest(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: its files (in its directory), its size and special
    tokens (which a caller may have changed in memory)."""
    hasher = xxhash.xxh3_128()
    directory = Path(tokenizer.name_or_path or ".")
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            hasher.update(f"{name}:{file_digest(path)['xxh3_128']}\n".encode())
    hasher.update(json.dumps([len(tokenizer), sorted(tokenizer.all_special_tokens)]).encode())
    return hasher.hexdigest()


def content_digest(source: Any, files: list[Path]) -> str:
    """A hash of a source's contents: its files' sizes and hashes, in order; for a dataset, its
    `datasets` fingerprint."""
    if source.dataset:
        return load_hf_dataset(source.dataset, source.subset, source.split)._fingerprint
    hasher = xxhash.xxh3_128()
    for path in files:
        digest = file_digest(path)
        hasher.update(f"{path.name}:{digest['bytes']}:{digest['xxh3_128']}\n".encode())
    return hasher.hexdigest()


def cache_key(source: Any, files: list[Path], tokenizer: Any, settings: dict[str, Any]) -> str:
    """The cache entry's name for a source (see the module docstring)."""
    described = {
        "format": KEY_VERSION,
        "source": {
            key: getattr(source, key)
            for key in ("path", "dataset", "subset", "split")
            + ("messages_column", "prompt_column", "completion_column")
        },
        "content": content_digest(source, files),
        "tokenizer": tokenizer_digest(tokenizer),
        **settings,
    }
    return xxhash.xxh3_128(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CacheRead:
    """What `DataCache.load` found: the samples, whether they came from the entry, and one line
    for each damaged or outdated file it met (already removed, or replaced)."""

    samples: SourceSamples
    hit: bool
    problems: tuple[str, ...] = ()


def _one_rank(value: Any) -> list[Any]:
    return [value]


@dataclass(frozen=True)
class DataCache:
    """Where tokenized sources are kept and how this process shares the work: rank `rank` of
    `world_size`; `gather(value)` returns every rank's value in rank order, on every rank (a
    collective under torchrun, which also waits for all of them; `[value]` in one process)."""

    directory: Path
    rank: int = 0
    world_size: int = 1
    gather: Callable[[Any], list[Any]] = _one_rank

    def entry(self, key: str) -> Path:
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    def share(self, key: str, rank: int) -> Path:
        return self.directory / f"{key}.share{rank}{ENTRY_SUFFIX}"

    def load(self, key: str, tokenize_share: Callable[[int, int], SourceSamples]) -> CacheRead:
        """The entry `key`, tokenized first (split over the ranks) when it is missing or fails
        its check on any rank."""
        entry, legacy = self.entry(key), self.directory / f"{key}{LEGACY_SUFFIX}"
        samples, problem = None, None
        try:
            samples = read_entry(entry)
        except FileNotFoundError:
            if legacy.is_file():
                problem = (
                    f"{legacy}: a pickled cache entry of an older fnt, not loaded (a cache is "
                    "read as data only)"
                )
        except (EntryProblem, OSError) as exc:
            problem = str(exc)
        views = self.gather((samples is not None, problem))
        if samples is not None and all(hit for hit, _ in views):
            return CacheRead(samples, hit=True)
        problems = _unique(p for _, p in views if p)
        if problems and self.rank == 0:
            entry.unlink(missing_ok=True)
            legacy.unlink(missing_ok=True)
        reported = [f"{p}; removed it, tokenizing the source again" for p in problems]
        merged, share_problems = self.tokenize(key, tokenize_share)
        if merged.error is not None:
            raise DataError(merged.error[1])
        if self.rank == 0:
            write_entry_(merged, entry)
        return CacheRead(merged, hit=False, problems=tuple(reported + share_problems))

    def tokenize(
        self, key: str, tokenize_share: Callable[[int, int], SourceSamples]
    ) -> tuple[SourceSamples, list[str]]:
        """The source tokenized, each rank a share exchanged through the cache directory; and
        one line for each share that failed its check."""
        self.directory.mkdir(parents=True, exist_ok=True)
        share = tokenize_share(self.rank, self.world_size)
        if self.world_size == 1:
            return share, []
        write_entry_(share, self.share(key, self.rank))
        self.gather(None)  # every share is written
        shares: list[Optional[SourceSamples]] = []
        failed = []
        for r in range(self.world_size):
            if r == self.rank:  # its own share is in memory: the others' check the file
                shares.append(share)
                continue
            try:
                shares.append(read_entry(self.share(key, r)))
            except (EntryProblem, OSError) as exc:
                shares.append(None)
                failed.append((r, str(exc)))
        # Every rank has read every share once this returns. A share that failed on any rank
        # is tokenized again by every other one, so no rank merges a share another refused.
        seen = sorted({item for view in self.gather(failed) for item in view})
        for r in sorted({r for r, _ in seen} - {self.rank}):
            shares[r] = tokenize_share(r, self.world_size)
        if self.rank == 0:
            for r in range(self.world_size):
                self.share(key, r).unlink(missing_ok=True)
        problems = [f"{p}; tokenized that share again" for p in _unique(p for _, p in seen)]
        return merge_shares(shares), problems


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))
