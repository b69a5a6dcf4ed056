"""SFT batches from JSONL sources. Side effects: `load_source_data` reads and tokenizes the sources
once, so data errors surface before training; `SourceData.locate` reads a bad token's record again
(for its error message); the rest is pure.

Every rank plans each global step identically (fnt.data.packing), then materializes only its own
rows (`rank_share`), split into micro-batches of micro_batch_size rows. The data position in each
batch is therefore global and the same on every rank, and a step's batch is a pure function of the
position it starts at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from fnt.batch import BadToken, SftBatch
from fnt.data.cache import DataCache
from fnt.data.chat import chat_masking
from fnt.data.corpus import Corpus
from fnt.data.load import DataSource, load_corpus, sample_origin
from fnt.data.order import SampleOrder
from fnt.data.packing import StepPlan, pack_rows, plan_step, step_metrics, steps_for_epochs
from fnt.distributed.parallel import check_batch_layout, rank_share
from fnt.model.tokenizer import pad_token_id
from fnt.state import Progress, Stateless


class DataConfig(Protocol):
    sources: Sequence[DataSource]
    overlong: str
    shuffle: bool
    loss_mask: Sequence[str]
    train_turns: str
    train_reasoning: bool
    chat_template: str


@dataclass(frozen=True)
class PlannedData(Stateless):
    """What SFT's and DPO's data share: a tokenized corpus, its sample order and this rank's
    batch layout, each step planned the same on every rank (fnt.data.packing). All it has to
    remember is the data position, which Progress holds."""

    corpus: Any
    """A Corpus or PairCorpus: anything with `length(sample_id)`, 0 for a dropped sample."""
    order: SampleOrder
    seq_len: int
    batch_size: int
    """Rows per step over all ranks."""
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    pad_token_id: int
    sources: tuple[DataSource, ...] = ()
    """The data sources the corpus was read from, in its order (for `locate`)."""

    def __post_init__(self) -> None:
        check_batch_layout(
            self.batch_size, self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size
        )

    def plan(self, progress: Progress) -> StepPlan:
        """The global plan of the update after `progress`."""
        self.order.check(progress.data)
        return plan_step(
            self.order,
            progress.data,
            self.corpus.length,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
        )

    def steps_for_epochs(self, epochs: float) -> int:
        """The steps that make `epochs` passes over the data from the start (max_epochs)."""
        return steps_for_epochs(
            self.order,
            self.corpus.length,
            epochs,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
        )


@dataclass(frozen=True)
class SourceData(PlannedData):
    """SFT's data: chats or text of data.sources (a SampleSource)."""

    corpus: Corpus

    def batch(self, progress: Progress) -> SftBatch:
        """This rank's batch of the update after `progress`: it starts at `progress.data` and
        ends at its `data_after`."""
        return rank_batch(
            self.plan(progress),
            self.corpus,
            seq_len=self.seq_len,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            pad_token_id=self.pad_token_id,
        )

    def locate(self, progress: Progress, bad: BadToken) -> str:
        """Where a token of this rank's batch after `progress` comes from: its sample's record
        (`file, line N`, read again now), the token's place in the sample, and the cache entry
        the sample's tokens were read from. Only for a message, so it may take its time."""
        plan = self.plan(progress)
        rows = rank_share(plan.rows, self.dp_rank, self.dp_size, what="rows per step")
        row = rows[bad.micro_batch * self.micro_batch_size + bad.row]
        if bad.document >= len(row):
            return (
                f"the padding of update {progress.step + 1}'s row {bad.row} in micro-batch "
                f"{bad.micro_batch} (the tokenizer's pad token)"
            )
        where, entry = sample_origin(self.corpus, self.sources, row[bad.document])
        cached = f" (read from the cache entry {entry})" if entry else ""
        return f"{where}, token {bad.offset} of its sample{cached}"


def source_order(source_sizes: Sequence[int], data_cfg: DataConfig, seed: int) -> SampleOrder:
    """The order samples are drawn in: data.sources mixed by weight, shuffled or not."""
    return SampleOrder(
        source_sizes=tuple(source_sizes),
        weights=tuple(float(source.weight) for source in data_cfg.sources),
        seed=seed,
        shuffle=data_cfg.shuffle,
    )


def load_source_data(
    data_cfg: DataConfig,
    tokenizer,
    *,
    seed: int,
    seq_len: int,
    batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    progress: bool = False,
    cache: DataCache | None = None,
) -> SourceData:
    """Read and tokenize the sources; the batch layout is checked before any file is read.
    `progress` shows the tokenization's progress (fnt.obs.console; rank 0); `cache` keeps and
    reuses the tokenized sources (fnt.data.cache)."""
    check_batch_layout(batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    pad = pad_token_id(tokenizer)
    corpus = load_corpus(
        data_cfg.sources,
        tokenizer,
        seq_len=seq_len,
        overlong=data_cfg.overlong,
        masking=chat_masking(data_cfg, tokenizer),
        progress=progress,
        cache=cache,
        on_bad_sample=data_cfg.on_bad_sample,
    )
    return SourceData(
        corpus,
        source_order(corpus.source_sizes, data_cfg, seed),
        seq_len,
        batch_size,
        micro_batch_size,
        dp_rank,
        dp_size,
        pad_token_id=pad,
        sources=tuple(data_cfg.sources),
    )


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
    rows = rank_share(plan.rows, dp_rank, dp_size, what="rows per step")
    micro_batches = tuple(
        pack_rows(
            [
                [corpus.tokens(sample_id) for sample_id in row]
                for row in rows[i : i + micro_batch_size]
            ],
            seq_len=seq_len,
            pad_token_id=pad_token_id,
        )
        for i in range(0, len(rows), micro_batch_size)
    )
    return SftBatch(
        micro_batches=micro_batches,
        num_samples=sum(len(row) for row in rows),
        data_after=plan.data_after,
        metrics=step_metrics(plan, corpus, seq_len=seq_len),
    )
