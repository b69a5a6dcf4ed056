"""Plan a global step's rows, pack them into tensors and measure them. Pure: no side effects.

A step is planned from the global sample order alone, so every rank computes the same plan and
the data position stays global: greedily, samples go into the current row until the next one does
not fit, which starts a new row; the step ends when a sample would open row batch_size + 1 (that
sample starts the next step). Dropped samples are consumed and counted but not packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import torch
from torch import Tensor

from fnt.batch import DataPosition, PackedRows
from fnt.data.corpus import Corpus, SampleFate
from fnt.data.order import SampleOrder, source_quotas


@dataclass(frozen=True)
class StepPlan:
    """The samples of one optimizer step over all ranks, the same on every rank."""

    rows: tuple[tuple[int, ...], ...]
    """Global sample ids packed into each of the batch_size rows, in order."""
    skipped: tuple[int, ...]
    """Dropped samples this step consumed without packing them."""
    data_after: DataPosition
    """The position of the first sample the next step consumes."""


def plan_step(
    order: SampleOrder,
    start: DataPosition,
    sample_length: Callable[[int], int],
    *,
    seq_len: int,
    batch_size: int,
) -> StepPlan:
    """Fill exactly batch_size rows of seq_len tokens greedily from the order, from start on.

    sample_length(id) is the sample's token count, 0 for a dropped sample; it never exceeds seq_len.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows: list[tuple[int, ...]] = []
    row: list[int] = []
    filled = 0
    skipped: list[int] = []
    skipped_in_a_row = 0
    samples = order.iter_from(start)
    while True:
        position, sample_id = next(samples)
        length = sample_length(sample_id)
        if length > seq_len:
            raise ValueError(f"sample {sample_id} has {length} tokens, more than seq_len={seq_len}")
        if length == 0:
            skipped.append(sample_id)
            skipped_in_a_row += 1
            # A whole epoch without a usable sample: make sure one will ever come (the order is
            # endless, so otherwise this loop would be too). Checked once, only in that case.
            if skipped_in_a_row == order.epoch_length:
                require_a_drawable_sample(order, sample_length)
            continue
        skipped_in_a_row = 0
        if filled + length > seq_len:
            if len(rows) + 1 == batch_size:
                return StepPlan(tuple([*rows, tuple(row)]), tuple(skipped), position)
            rows.append(tuple(row))
            row, filled = [], 0
        row.append(sample_id)
        filled += length


def steps_for_epochs(
    order: SampleOrder,
    sample_length: Callable[[int], int],
    epochs: float,
    *,
    seq_len: int,
    batch_size: int,
) -> int:
    """The optimizer steps a fresh run takes to consume `epochs` passes over the data: the first
    step whose data position afterwards is at least epochs x epoch_length samples from the start
    (a fractional pass rounds up to whole samples, and to the step that reaches them). Pure.

    The steps are planned exactly as training plans them (`plan_step`), so a run stopping at
    the result has consumed every sample of those epochs, and no step more than it needs."""
    if not (math.isfinite(epochs) and epochs > 0):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs}")
    target = math.ceil(Fraction(epochs) * order.epoch_length)
    position, steps = DataPosition(), 0
    while position.epoch * order.epoch_length + position.cursor < target:
        position = plan_step(
            order, position, sample_length, seq_len=seq_len, batch_size=batch_size
        ).data_after
        steps += 1
    return steps


def require_a_drawable_sample(order: SampleOrder, sample_length: Callable[[int], int]) -> None:
    """ValueError unless some source the order draws from (a share of an epoch above 0) has a
    usable sample (length > 0); over enough epochs, the order then reaches it."""
    first = 0
    for size, quota in zip(order.source_sizes, source_quotas(order.source_sizes, order.weights)):
        if quota and any(sample_length(i) for i in range(first, first + size)):
            return
        first += size
    raise ValueError(
        "no sample the data order draws is usable: each source either has no usable sample or a "
        "weight so small that its share of an epoch rounds to 0 samples"
    )


def pack_rows(
    rows: Sequence[Sequence[tuple[Tensor, Tensor]]], *, seq_len: int, pad_token_id: int
) -> PackedRows:
    """Rows of documents (input_ids, target_mask) packed back to back and padded to seq_len.

    The padding is one more document per row, with no targets, so it attends only to itself.
    """
    input_ids, position_ids, document_ids, loss_mask = [], [], [], []
    for row in rows:
        lengths = [len(ids) for ids, _ in row]
        pad = seq_len - sum(lengths)
        if pad < 0:
            raise ValueError(f"a row of {sum(lengths)} tokens does not fit seq_len={seq_len}")
        input_ids.append(torch.cat([ids for ids, _ in row] + [torch.full((pad,), pad_token_id)]))
        position_ids.append(torch.cat([torch.arange(n) for n in [*lengths, pad]]))
        document_ids.append(torch.cat([torch.full((n,), d) for d, n in enumerate([*lengths, pad])]))
        loss_mask.append(
            torch.cat([mask for _, mask in row] + [torch.zeros(pad, dtype=torch.bool)])
        )
    return PackedRows(
        input_ids=torch.stack(input_ids),
        position_ids=torch.stack(position_ids),
        document_ids=torch.stack(document_ids),
        loss_mask=torch.stack(loss_mask),
    )


def step_metrics(plan: StepPlan, corpus: Corpus, *, seq_len: int) -> dict[str, float]:
    """Data metrics of a whole step (all ranks), so they are the same on every rank.

    data/truncated, data/dropped_overlong, data/dropped_no_loss, data/dropped_bad: samples this
    step consumed with that fate. data/num_samples, data/num_tokens: packed samples and their
    (non-pad) tokens.
    data/loss_tokens: target tokens, e.g. to normalize the loss over all ranks and micro-batches.
    data/pad_fraction: padded share of the step's batch_size * seq_len positions.
    With two or more sources, progress/{source}/ratio_samples and ratio_tokens: each source's share
    of the step's packed samples and of their (non-pad) tokens.
    """
    packed = [sample_id for row in plan.rows for sample_id in row]
    fates = [corpus.fates[i] for i in [*packed, *plan.skipped]]
    tokens = [corpus.length(i) for i in packed]
    total_tokens = sum(tokens)
    metrics = {
        "data/truncated": float(fates.count(SampleFate.TRUNCATED)),
        "data/dropped_overlong": float(fates.count(SampleFate.DROPPED_OVERLONG)),
        "data/dropped_no_loss": float(fates.count(SampleFate.DROPPED_NO_LOSS)),
        "data/dropped_bad": float(fates.count(SampleFate.DROPPED_BAD)),
        "data/num_samples": float(len(packed)),
        "data/num_tokens": float(total_tokens),
        "data/loss_tokens": float(sum(int(corpus.tokens(i)[1].sum()) for i in packed)),
        "data/pad_fraction": 1.0 - total_tokens / (len(plan.rows) * seq_len),
    }
    if len(corpus.source_names) > 1:
        sources = [corpus.source_of(i) for i in packed]
        for s, name in enumerate(corpus.source_names):
            mine = [n for n, source in zip(tokens, sources) if source == s]
            metrics[f"progress/{name}/ratio_samples"] = len(mine) / len(packed)
            metrics[f"progress/{name}/ratio_tokens"] = sum(mine) / total_tokens
    return metrics
