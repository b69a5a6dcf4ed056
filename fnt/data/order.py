"""The sample order: which sample sits at each data position (epoch, cursor). Pure: no side effects.

What an epoch is with weighted sources:
- An epoch holds N samples, N = the total number of samples of all sources (dropped ones
  included), whatever the weights.
- Weights are relative shares of samples: source s contributes c_s samples to each epoch, N
  apportioned by weight with the largest-remainder rule, so c_s is within 1 of N * w_s / sum(w).
  With one source, or with weights proportional to the sources' sizes, an epoch is exactly one
  pass over every file. A weight so small that c_s rounds to 0 leaves the source out.
- Each source reads from its own endless stream: passes over its samples one after another,
  pass p being a permutation seeded by (seed, source index, p) when shuffling and file order
  otherwise. Epoch e takes the stream's positions [e * c_s, (e + 1) * c_s). An up-weighted source
  (c_s > n_s) thus repeats samples within an epoch; a down-weighted one shows the next part of
  its stream each epoch, and over many epochs every sample of a source is seen equally often
  (within one).
- Sources are interleaved smoothly: item j of source s gets the time (j + 1/2) / c_s and the
  epoch lists the items by time, ties to the lower source index. Every prefix of an epoch, and so
  every step, then holds each source close to its share c_s / N: within
  (1 + #sources * c_s / N) / 2 samples, and within half a sample when there are two sources.
When shuffling, every epoch has a different order (new passes); the interleaving pattern of
sources is the same in each epoch.

Resume is exact by construction: `epoch_order` depends only on (sizes, weights, seed, shuffle,
epoch), and a data position indexes into it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterator, Sequence

import torch
from torch import Tensor

from fnt.batch import DataPosition


def source_quotas(sizes: Sequence[int], weights: Sequence[float]) -> tuple[int, ...]:
    """Samples each source contributes to an epoch: sum(sizes) apportioned by weight."""
    total_weight = math.fsum(weights)
    epoch_length = sum(sizes)
    exact = [epoch_length * w / total_weight for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda s: (quotas[s] - exact[s], s))
    for s in by_remainder[: epoch_length - sum(quotas)]:
        quotas[s] += 1
    return tuple(quotas)


def stream_seed(seed: int, source: int, pass_index: int) -> int:
    """A 63-bit seed for one pass over one source, stable across processes and platforms."""
    digest = hashlib.blake2b(f"{seed}/{source}/{pass_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def source_stream(
    size: int, *, seed: int, source: int, start: int, count: int, shuffle: bool
) -> Tensor:
    """Local sample indices at positions [start, start + count) of a source's endless stream."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    first_pass, last_pass = start // size, (start + count - 1) // size
    passes = []
    for p in range(first_pass, last_pass + 1):
        if shuffle:
            generator = torch.Generator().manual_seed(stream_seed(seed, source, p))
            passes.append(torch.randperm(size, generator=generator))
        else:
            passes.append(torch.arange(size))
    offset = start - first_pass * size
    return torch.cat(passes)[offset : offset + count]


def interleave(quotas: Sequence[int]) -> Tensor:
    """Source index at each epoch position: item j of source s at time (j + 1/2) / quota_s."""
    times = torch.cat([(torch.arange(c, dtype=torch.float64) + 0.5) / c for c in quotas if c])
    sources = torch.cat([torch.full((c,), s) for s, c in enumerate(quotas) if c])
    # Same rational time gives the same double, and the stable sort keeps source order on ties.
    return sources[torch.sort(times, stable=True).indices]


def epoch_order(
    sizes: Sequence[int], weights: Sequence[float], *, seed: int, epoch: int, shuffle: bool
) -> Tensor:
    """Global sample ids [N] int64 of one epoch, in the order they are consumed."""
    quotas = source_quotas(sizes, weights)
    sources = interleave(quotas)
    order = torch.empty(len(sources), dtype=torch.int64)
    first_id = 0
    for s, (size, quota) in enumerate(zip(sizes, quotas)):
        local = source_stream(
            size, seed=seed, source=s, start=epoch * quota, count=quota, shuffle=shuffle
        )
        order[sources == s] = local + first_id
        first_id += size
    return order


@dataclass(frozen=True)
class SampleOrder:
    """The order of samples over all epochs for fixed sources, weights, seed and shuffle flag."""

    source_sizes: tuple[int, ...]
    weights: tuple[float, ...]
    seed: int
    shuffle: bool

    def __post_init__(self) -> None:
        if not self.source_sizes or len(self.source_sizes) != len(self.weights):
            raise ValueError("need one weight per source and at least one source")
        if any(size < 1 for size in self.source_sizes):
            raise ValueError(f"every source needs at least one sample, got {self.source_sizes}")
        if any(not (math.isfinite(w) and w > 0) for w in self.weights):
            raise ValueError(f"source weights must be finite and > 0, got {self.weights}")

    @cached_property
    def epoch_length(self) -> int:
        return sum(self.source_sizes)

    def epoch(self, epoch: int) -> Tensor:
        """Global sample ids [N] int64 of an epoch, in order; shared, so do not mutate it."""
        return _memoized_epoch_order(self, epoch)

    def check(self, position: DataPosition) -> None:
        if position.epoch < 0 or not 0 <= position.cursor < self.epoch_length:
            raise ValueError(
                f"data position {position} is outside the data: an epoch has "
                f"{self.epoch_length} samples (did the data files change since it was saved?)"
            )

    def iter_from(self, start: DataPosition) -> Iterator[tuple[DataPosition, int]]:
        """(position, global sample id) from start on, endlessly; positions have cursor < N."""
        self.check(start)
        epoch, cursor = start.epoch, start.cursor
        chunk = 4096  # converts the order to Python ints a slice at a time
        while True:
            ids = self.epoch(epoch)
            for chunk_start in range(cursor, self.epoch_length, chunk):
                for offset, sample_id in enumerate(ids[chunk_start : chunk_start + chunk].tolist()):
                    yield DataPosition(epoch, chunk_start + offset), sample_id
            epoch, cursor = epoch + 1, 0


@lru_cache(maxsize=2)
def _memoized_epoch_order(order: SampleOrder, epoch: int) -> Tensor:
    # Two entries: a step may straddle an epoch boundary, and both epochs are then in use.
    return epoch_order(
        order.source_sizes, order.weights, seed=order.seed, epoch=epoch, shuffle=order.shuffle
    )
