"""The SFT batch stream. Side effects: sft_batches reads and tokenizes the sources once, when it is
called (not at the first batch), so data errors surface before training; the rest is pure.

Every rank plans each global step identically (fnt.data.packing), then materializes only its own
rows: rank r gets rows r * per_rank .. (r + 1) * per_rank - 1 with per_rank = batch_size // dp_size,
split into micro-batches of micro_batch_size rows. The data position in each batch is therefore
global and the same on every rank.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from fnt.batch import DataPosition, SftBatch
from fnt.data.corpus import Corpus
from fnt.data.load import Source, load_corpus
from fnt.data.order import SampleOrder
from fnt.data.packing import StepPlan, pack_rows, plan_step, step_metrics


class DataConfig(Protocol):
    sources: Sequence[Source]
    overlong: str
    shuffle: bool


def sft_batches(
    data_cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    seq_len: int,
    batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start: DataPosition = DataPosition(),
) -> Iterator[SftBatch]:
    """This rank's batches from start on, endlessly (epochs wrap); batch k ends at data_after."""
    check_batch_layout(batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    pad_token_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token to pad rows with")
    corpus = load_corpus(data_cfg.sources, tokenizer, seq_len=seq_len, overlong=data_cfg.overlong)
    order = SampleOrder(
        source_sizes=corpus.source_sizes,
        weights=tuple(float(source.weight) for source in data_cfg.sources),
        seed=seed,
        shuffle=data_cfg.shuffle,
    )
    return iter_sft_batches(
        corpus,
        order,
        seq_len=seq_len,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        pad_token_id=pad_token_id,
        start=start,
    )


def iter_sft_batches(
    corpus: Corpus,
    order: SampleOrder,
    *,
    seq_len: int,
    batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    pad_token_id: int,
    start: DataPosition,
) -> Iterator[SftBatch]:
    """The batch stream over a tokenized corpus; arguments are checked before the first batch."""
    check_batch_layout(batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    order.check(start)

    def batches() -> Iterator[SftBatch]:
        position = start
        while True:
            plan = plan_step(order, position, corpus.length, seq_len=seq_len, batch_size=batch_size)
            yield rank_batch(
                plan,
                corpus,
                seq_len=seq_len,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                pad_token_id=pad_token_id,
            )
            position = plan.data_after

    return batches()


def rank_batch(
    plan: StepPlan,
    corpus: Corpus,
    *,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    pad_token_id: int,
) -> SftBatch:
    """This rank's share of a planned step, as micro-batches, with the step's data metrics."""
    per_rank = len(plan.rows) // dp_size
    rows = plan.rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro_batches = tuple(
        pack_rows(
            [
                [corpus.tokens(sample_id) for sample_id in row]
                for row in rows[i : i + micro_batch_size]
            ],
            seq_len=seq_len,
            pad_token_id=pad_token_id,
        )
        for i in range(0, per_rank, micro_batch_size)
    )
    return SftBatch(
        micro_batches=micro_batches,
        num_samples=sum(len(row) for row in rows),
        data_after=plan.data_after,
        metrics=step_metrics(plan, corpus, seq_len=seq_len),
    )


def check_batch_layout(
    batch_size: int, micro_batch_size: int, *, dp_rank: int, dp_size: int
) -> None:
    """ValueError unless batch_size rows split evenly over ranks and then into micro-batches."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    if micro_batch_size < 1 or batch_size < 1:
        raise ValueError(
            f"batch_size and micro_batch_size must be >= 1, got {batch_size} and {micro_batch_size}"
        )
    if batch_size % (dp_size * micro_batch_size):
        raise ValueError(
            f"batch_size={batch_size} (global rows per step) must be a multiple of "
            f"dp_size * micro_batch_size = {dp_size} * {micro_batch_size}"
        )
