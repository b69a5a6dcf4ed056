"""Tokenized samples of all sources, fitted to the sequence length. Pure: no side effects.

Samples get global ids: source 0 owns ids 0..n0-1, source 1 the next n1 ids, and so on, in file
order. Tokens live in two flat tensors with offsets, so millions of samples cost little memory.
A dropped sample keeps its id (so the data order, and with it resume, does not depend on
`seq_len` or the overlong policy) but holds no tokens; packing skips it and counts it.
"""

from __future__ import annotations

import bisect
import enum
from array import array
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

OVERLONG_POLICIES = ("auto", "truncate", "drop", "error")


def overlong_policy(policy: str, *, chat: bool) -> str:
    """The policy for one record: "auto" drops an over-long chat (cutting one from the end loses
    its last answers, or all of them) and truncates a prompt/completion pair. Pure."""
    if policy == "auto":
        return "drop" if chat else "truncate"
    return policy


class SampleFate(enum.IntEnum):
    """What fitting to the sequence length did to a sample."""

    KEPT = 0
    TRUNCATED = 1
    """Longer than seq_len: its first seq_len tokens are kept."""
    DROPPED_OVERLONG = 2
    """Longer than seq_len, under the 'drop' policy, or truncated to no target token at all."""
    DROPPED_NO_LOSS = 3
    """No target token even at full length (a chat without a trained turn)."""
    DROPPED_BAD = 4
    """A bad chat (unknown role, content not a string, ...) that data.on_bad_sample skipped."""

    @property
    def dropped(self) -> bool:
        return self in (
            SampleFate.DROPPED_OVERLONG,
            SampleFate.DROPPED_NO_LOSS,
            SampleFate.DROPPED_BAD,
        )


def fit_to_length(
    input_ids: Sequence[int], targets: Sequence[bool], *, seq_len: int, overlong: str
) -> tuple[list[int], list[bool], SampleFate]:
    """A sample as it enters the corpus: at most seq_len tokens, never its first token a target.

    A document's first token has no predecessor to be predicted from, so its target flag is
    cleared here, once, for every sample. ValueError for an over-long sample under 'error'.
    `overlong` is a record's policy ("auto" resolved: `overlong_policy`); a sample that
    truncation leaves without a target counts as over-long, since its length is what lost it.
    """
    if overlong not in OVERLONG_POLICIES[1:]:
        raise ValueError(f"data.overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    fate = SampleFate.KEPT
    if len(input_ids) > seq_len:
        if overlong == "error":
            raise ValueError(
                f"sample has {len(input_ids)} tokens, more than seq_len={seq_len} "
                "(data.overlong='error'; use 'truncate' or 'drop' to accept such samples)"
            )
        if overlong == "drop":
            return [], [], SampleFate.DROPPED_OVERLONG
        fate = SampleFate.TRUNCATED
    kept_ids = list(input_ids[:seq_len])
    kept_targets = [False, *targets[1:seq_len]] if kept_ids else []
    if not any(kept_targets):
        lost = fate == SampleFate.TRUNCATED and any(targets[1:])
        return [], [], SampleFate.DROPPED_OVERLONG if lost else SampleFate.DROPPED_NO_LOSS
    return kept_ids, kept_targets, fate


@dataclass(frozen=True)
class Corpus:
    """Every sample of every source, tokenized; index with global sample ids."""

    source_names: tuple[str, ...]
    source_sizes: tuple[int, ...]
    """Samples per source (dropped ones included), in source order."""
    input_ids: Tensor  # [total_tokens] int64, all samples back to back
    target_mask: Tensor  # [total_tokens] bool
    offsets: tuple[int, ...]
    """Sample i's tokens are input_ids[offsets[i]:offsets[i + 1]]."""
    fates: tuple[SampleFate, ...]
    notes: tuple[str, ...] = ()
    """What a reader of the data should know (one line each), printed at the start by rank 0."""
    records: Optional[Tensor] = None  # [num_samples] int64, each sample's record in its source
    cache_entries: tuple[str, ...] = ()
    """Per source, the cache entry its samples were read from ("" when tokenized by this run),
    for the messages that locate a sample."""

    @staticmethod
    def build(
        sources: Iterable[tuple[str, Iterable[tuple[Sequence[int], Sequence[bool], SampleFate]]]],
    ) -> Corpus:
        """A corpus from (source name, fitted samples) pairs; samples come from fit_to_length."""
        parts = []
        for name, samples in sources:
            ids, targets, lengths, fates = array("q"), array("b"), [], []
            for sample_ids, sample_targets, fate in samples:
                if len(sample_ids) != len(sample_targets):
                    raise ValueError("a sample needs one target flag per token")
                ids.extend(sample_ids)
                targets.extend(sample_targets)
                lengths.append(len(sample_ids))
                fates.append(fate)
            parts.append((name, ids, targets, lengths, fates, range(len(lengths))))
        return Corpus.from_parts(parts)

    @staticmethod
    def from_parts(
        parts: Sequence[tuple[str, array, array, Sequence[int], Sequence[int], Sequence[int]]],
        cache_entries: tuple[str, ...] = (),
    ) -> Corpus:
        """A corpus from each source's samples back to back: (name, ids, targets, per-sample
        lengths, per-sample SampleFate values, per-sample record indices), as fnt.data.cache
        keeps them; `cache_entries` as the field says."""
        ids, targets, records = array("q"), array("b"), array("q")
        offsets, fates, names, sizes = [0], [], [], []
        for name, part_ids, part_targets, lengths, part_fates, part_records in parts:
            if len(part_ids) != len(part_targets) or sum(lengths) != len(part_ids):
                raise ValueError("a sample needs one target flag per token")
            names.append(name)
            sizes.append(len(lengths))
            ids.extend(part_ids)
            targets.extend(part_targets)
            records.extend(part_records)
            for length in lengths:
                offsets.append(offsets[-1] + length)
            fates.extend(SampleFate(f) for f in part_fates)
        return Corpus(
            source_names=tuple(names),
            source_sizes=tuple(sizes),
            input_ids=_to_tensor(ids, torch.int64),
            target_mask=_to_tensor(targets, torch.int8).bool(),
            offsets=tuple(offsets),
            fates=tuple(fates),
            records=_to_tensor(records, torch.int64),
            cache_entries=cache_entries,
        )

    @property
    def num_samples(self) -> int:
        return len(self.fates)

    def length(self, sample_id: int) -> int:
        """Tokens of a sample after fitting; 0 for a dropped sample."""
        return self.offsets[sample_id + 1] - self.offsets[sample_id]

    def tokens(self, sample_id: int) -> tuple[Tensor, Tensor]:
        """(input_ids [n] int64, target_mask [n] bool) of a sample, as views into the corpus."""
        start, end = self.offsets[sample_id], self.offsets[sample_id + 1]
        return self.input_ids[start:end], self.target_mask[start:end]

    def source_of(self, sample_id: int) -> int:
        return bisect.bisect_right(self._source_ends, sample_id)

    @cached_property
    def _source_ends(self) -> list[int]:
        return list(accumulate(self.source_sizes))


def _to_tensor(values: array, dtype: torch.dtype) -> Tensor:
    # frombuffer copies at memory speed, where torch.tensor(array) converts item by item.
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype).clone()
