"""Synthetic SFT data for debugging: packed counting sequences. Pure.

Each document counts upward from a random start (mod 256, the byte range of the tiny
tokenizer), so a model can learn it in a few steps. A step's rows are a pure function of
(seed, step), which makes resume exact without any stored iterator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fnt.batch import DataPosition, PackedRows, SftBatch
from fnt.distributed.parallel import check_batch_layout, rank_bounds
from fnt.state import Progress, Stateless

_VOCAB = 256


def synthetic_rows(
    seed: int, step: int, num_rows: int, seq_len: int
) -> tuple[PackedRows, list[int]]:
    """All rows of one step, and the number of documents in each row. Pure."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    input_ids = torch.empty(num_rows, seq_len, dtype=torch.int64)
    position_ids = torch.empty_like(input_ids)
    document_ids = torch.empty_like(input_ids)
    docs_per_row = []
    for row in range(num_rows):
        t, doc = 0, 0
        while t < seq_len:
            length = int(torch.randint(4, max(5, seq_len // 2) + 1, (1,), generator=gen))
            length = min(length, seq_len - t)
            start = int(torch.randint(0, _VOCAB, (1,), generator=gen))
            input_ids[row, t : t + length] = (start + torch.arange(length)) % _VOCAB
            position_ids[row, t : t + length] = torch.arange(length)
            document_ids[row, t : t + length] = doc
            t += length
            doc += 1
        docs_per_row.append(doc)
    loss_mask = position_ids > 0
    return PackedRows(input_ids, position_ids, document_ids, loss_mask), docs_per_row


def take_rows(rows: PackedRows, start: int, stop: int) -> PackedRows:
    return PackedRows(
        *(
            getattr(rows, f)[start:stop]
            for f in ("input_ids", "position_ids", "document_ids", "loss_mask")
        )
    )


def synthetic_batch(
    *,
    seed: int,
    step: int,
    start: DataPosition,
    batch_size: int,
    micro_batch_size: int,
    seq_len: int,
    dp_rank: int,
    dp_size: int,
) -> SftBatch:
    """This rank's batch of update number `step`, whose data stream starts at `start`."""
    rows, docs_per_row = synthetic_rows(seed, step, batch_size, seq_len)
    lo, hi = rank_bounds(batch_size, dp_rank, dp_size, what="rows per step")
    micro = tuple(take_rows(rows, i, i + micro_batch_size) for i in range(lo, hi, micro_batch_size))
    return SftBatch(
        micro_batches=micro,
        num_samples=sum(docs_per_row[lo:hi]),
        data_after=DataPosition(epoch=0, cursor=start.cursor + sum(docs_per_row)),
    )


@dataclass(frozen=True)
class SyntheticData(Stateless):
    """data.kind = "synthetic" as a SampleSource: its rows follow from (seed, step), so it has
    nothing to remember."""

    seed: int
    batch_size: int
    micro_batch_size: int
    seq_len: int
    dp_rank: int
    dp_size: int

    def __post_init__(self) -> None:
        check_batch_layout(
            self.batch_size, self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size
        )

    def batch(self, progress: Progress) -> SftBatch:
        """This rank's batch of update progress.step + 1."""
        return synthetic_batch(
            seed=self.seed,
            step=progress.step + 1,
            start=progress.data,
            batch_size=self.batch_size,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )
