"""Tokenize once: a cache of tokenized sources, shared by resumes and by other runs on the same
data, and the tokenization of a source split over the ranks. Side effects: reads the source
files (to hash them) and the tokenizer's files, reads and writes the cache directory, and
barriers under torchrun.

One file per source, `{cache_dir}/{key}.pt`. The key (`cache_key`) is an xxh3-128 hash of
everything the samples depend on: the cache format, the source's description (path or dataset,
columns), the contents of its files (a dataset: its `datasets` fingerprint), the tokenizer (its
files, its special tokens, its size), the chat template, the loss mask settings, seq_len and
data.overlong. Any change makes another key, so a stale entry is never read; entries are
written to a temporary name and renamed, so a reader never sees half of one.

On a miss every rank tokenizes every world-th record of the source (`tokenize_share`) and
writes its share next to the entry; after a barrier each rank reads all shares and merges them
back into record order, rank 0 writes the entry and removes the shares. A bad record on any
rank is reported by every rank alike (the first in record order), so no rank waits for another.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import xxhash

from fnt.data.hub import load_hf_dataset
from fnt.errors import DataError
from fnt.store.checksums import file_digest

CACHE_FORMAT = 1
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
    error: Optional[tuple[int, str]] = None  # (record, message) of the first bad record

    def add(self, record: int, ids, targets, fate: int) -> None:
        self.ids.extend(ids)
        self.targets.extend(targets)
        self.lengths.append(len(ids))
        self.fates.append(int(fate))
        self.records.append(record)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CACHE_FORMAT,
            "ids": torch.frombuffer(self.ids, dtype=torch.int64).clone() if self.ids else None,
            "targets": torch.frombuffer(self.targets, dtype=torch.int8).clone()
            if self.targets
            else None,
            "lengths": self.lengths,
            "fates": self.fates,
            "records": self.records,
            "trailing": self.trailing,
            "error": self.error,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SourceSamples:
        samples = SourceSamples(
            lengths=list(d["lengths"]),
            fates=list(d["fates"]),
            records=list(d["records"]),
            trailing=[tuple(t) for t in d["trailing"]],
            error=tuple(d["error"]) if d["error"] else None,
        )
        if d["ids"] is not None:
            samples.ids.frombytes(d["ids"].numpy().tobytes())
            samples.targets.frombytes(d["targets"].numpy().tobytes())
        return samples


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
        "format": CACHE_FORMAT,
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
class DataCache:
    """Where tokenized sources are kept and how this process shares the work: rank `rank` of
    `world_size`, `barrier` waiting for all of them (a no-op in one process)."""

    directory: Path
    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = lambda: None

    def load(self, key: str, tokenize_share: Callable[[int, int], SourceSamples]) -> SourceSamples:
        """The entry `key`, tokenized first (split over the ranks) on a miss."""
        entry = self.directory / f"{key}.pt"
        if entry.is_file():
            return SourceSamples.from_dict(torch.load(entry, weights_only=False))
        self.directory.mkdir(parents=True, exist_ok=True)
        share = tokenize_share(self.rank, self.world_size)
        if self.world_size == 1:
            merged = share
        else:
            _write_atomic(share.to_dict(), self.directory / f"{key}.share{self.rank}.pt")
            self.barrier()
            merged = merge_shares(
                [
                    SourceSamples.from_dict(
                        torch.load(self.directory / f"{key}.share{r}.pt", weights_only=False)
                    )
                    for r in range(self.world_size)
                ]
            )
            self.barrier()  # every rank has read every share
        if self.rank == 0 and self.world_size > 1:
            for r in range(self.world_size):
                (self.directory / f"{key}.share{r}.pt").unlink(missing_ok=True)
        if merged.error is not None:
            raise DataError(merged.error[1])
        if self.rank == 0:
            _write_atomic(merged.to_dict(), entry)
        return merged


def _write_atomic(state: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
