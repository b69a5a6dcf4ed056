"""The per-rank batch stream: ranks share one global plan, and resume continues exactly."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.batch import DataPosition, SftBatch
from fnt.config.schema import DataConfig, DataSourceConfig
from fnt.data import SampleOrder, SourceData, load_source_data
from fnt.state import Progress

SEQ_LEN = 16
PAD = 999


def batches_from(data: SourceData, start: DataPosition = DataPosition()):
    """Step after step from `start`, each batch starting where the previous one ended."""
    position = start
    while True:
        batch = data.batch(Progress(data=position))
        yield batch
        position = batch.data_after


def stream(
    corpus, order, *, batch_size, micro_batch_size, dp_rank=0, dp_size=1, start=DataPosition()
):
    data = SourceData(corpus, order, SEQ_LEN, batch_size, micro_batch_size, dp_rank, dp_size, PAD)
    return batches_from(data, start)


def all_rows(batch: SftBatch) -> dict[str, torch.Tensor]:
    """The batch's micro-batches concatenated back into rows, field by field."""
    fields = ("input_ids", "position_ids", "document_ids", "loss_mask")
    return {f: torch.cat([getattr(mb, f) for mb in batch.micro_batches]) for f in fields}


def same_rows(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[f], b[f]) for f in a)


corpus_lengths = st.lists(
    st.lists(st.one_of(st.just(0), st.integers(2, SEQ_LEN)), min_size=1, max_size=10),
    min_size=1,
    max_size=3,
).filter(lambda sources: any(length for source in sources for length in source))


@settings(max_examples=40, deadline=None)
@given(
    lengths=corpus_lengths,
    seed=st.integers(0, 99),
    per_rank_micro_batches=st.integers(1, 2),
    micro_batch_size=st.integers(1, 2),
)
def test_two_ranks_together_produce_the_one_rank_rows_and_positions(
    make_corpus, lengths, seed, per_rank_micro_batches, micro_batch_size
):
    corpus = make_corpus(lengths)
    order = SampleOrder(corpus.source_sizes, (1.0,) * len(lengths), seed=seed, shuffle=True)
    batch_size = 2 * per_rank_micro_batches * micro_batch_size
    one = stream(corpus, order, batch_size=batch_size, micro_batch_size=micro_batch_size)
    ranks = [
        stream(
            corpus,
            order,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=r,
            dp_size=2,
        )
        for r in range(2)
    ]
    for _ in range(4):
        whole, *shares = [next(batches) for batches in (one, *ranks)]
        for share in shares:
            share.check()
            assert len(share.micro_batches) == per_rank_micro_batches
            assert all(
                mb.input_ids.shape == (micro_batch_size, SEQ_LEN) for mb in share.micro_batches
            )
            assert share.data_after == whole.data_after
            assert share.metrics == whole.metrics
        joined = {f: torch.cat([all_rows(s)[f] for s in shares]) for f in all_rows(whole)}
        assert same_rows(joined, all_rows(whole))
        assert sum(s.num_samples for s in shares) == whole.num_samples


@settings(max_examples=25, deadline=None)
@given(lengths=corpus_lengths, seed=st.integers(0, 99), resume_after=st.integers(1, 5))
def test_resuming_from_a_batch_data_after_continues_exactly(
    make_corpus, lengths, seed, resume_after
):
    corpus = make_corpus(lengths)
    order = SampleOrder(
        corpus.source_sizes, tuple(range(1, len(lengths) + 1)), seed=seed, shuffle=True
    )
    through = list(
        islice(stream(corpus, order, batch_size=2, micro_batch_size=1), resume_after + 3)
    )
    resumed = stream(
        corpus, order, batch_size=2, micro_batch_size=1, start=through[resume_after - 1].data_after
    )
    for expected, batch in zip(through[resume_after:], resumed):
        assert same_rows(all_rows(batch), all_rows(expected))
        assert batch.data_after == expected.data_after and batch.metrics == expected.metrics


def write_sources(tmp_path, count_a: int, count_b: int) -> DataConfig:
    a, b = tmp_path / "chat.jsonl", tmp_path / "pairs.jsonl"
    a.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": "a" * i},
                    ]
                }
            )
            + "\n"
            for i in range(count_a)
        )
    )
    b.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) + "\n" for i in range(count_b)
        )
    )
    return DataConfig(
        kind="sources",
        sources=(
            DataSourceConfig(path=str(a), weight=3.0, name=""),
            DataSourceConfig(path=str(b), weight=1.0, name="pc"),
        ),
        overlong="truncate",
        shuffle=True,
    )


def test_load_source_data_reads_the_files_once_then_gives_checked_batches_over_epochs(
    tmp_path, tokenizer
):
    data = write_sources(tmp_path, 6, 6)
    loaded = load_source_data(
        data, tokenizer, seed=1, seq_len=64, batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1
    )
    for path in (tmp_path / "chat.jsonl", tmp_path / "pairs.jsonl"):
        path.unlink()  # everything was read when load_source_data was called
    batches = batches_from(loaded)
    positions = []
    for batch in islice(batches, 8):
        batch.check()
        assert len(batch.micro_batches) == 2
        assert batch.micro_batches[0].input_ids.shape == (2, 64)
        assert set(batch.metrics) >= {
            "data/truncated",
            "data/dropped_overlong",
            "data/dropped_no_loss",
            "data/num_samples",
            "data/num_tokens",
            "data/loss_tokens",
            "data/pad_fraction",
            "progress/chat/ratio_samples",
            "progress/chat/ratio_tokens",
            "progress/pc/ratio_samples",
            "progress/pc/ratio_tokens",
        }
        rows = all_rows(batch)
        padded_rows = (rows["input_ids"][:, -1] == tokenizer.pad_token_id).sum().item()
        assert batch.num_samples == (rows["position_ids"] == 0).sum().item() - padded_rows
        assert batch.metrics["data/num_samples"] == batch.num_samples
        assert batch.metrics["data/loss_tokens"] == rows["loss_mask"].sum().item()
        pad_tokens = (rows["input_ids"] == tokenizer.pad_token_id).sum().item()
        assert batch.metrics["data/num_tokens"] == rows["input_ids"].numel() - pad_tokens
        assert batch.metrics["data/pad_fraction"] == pytest.approx(
            pad_tokens / rows["input_ids"].numel()
        )
        positions.append(batch.data_after)
    assert positions[-1].epoch >= 1  # the stream wrapped into later epochs
    assert positions == sorted(positions, key=lambda p: (p.epoch, p.cursor))


def test_pad_is_the_tokenizers_pad_token(tmp_path, tokenizer):
    data = write_sources(tmp_path, 1, 1)
    batch = load_source_data(
        data, tokenizer, seed=0, seq_len=128, batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1
    ).batch(Progress())
    assert batch.micro_batches[0].input_ids[0, -1].item() == tokenizer.pad_token_id


@pytest.mark.parametrize(
    ("batch_size", "micro_batch_size", "dp_rank", "dp_size", "message"),
    [
        (4, 3, 0, 1, "multiple of dp_size \\* micro_batch_size"),
        (6, 2, 0, 2, "multiple of dp_size \\* micro_batch_size"),
        (4, 1, 2, 2, "dp_rank < dp_size"),
        (0, 1, 0, 1, ">= 1"),
    ],
)
def test_a_batch_layout_that_does_not_split_evenly_is_rejected_before_reading(
    tmp_path, tokenizer, batch_size, micro_batch_size, dp_rank, dp_size, message
):
    missing = DataConfig(
        kind="sources",
        sources=(DataSourceConfig(path=str(tmp_path / "no.jsonl"), weight=1.0, name=""),),
        overlong="truncate",
        shuffle=True,
    )
    with pytest.raises(ValueError, match=message):
        load_source_data(
            missing,
            tokenizer,
            seed=0,
            seq_len=64,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )


def test_a_start_outside_the_data_is_rejected(tmp_path, tokenizer):
    data = load_source_data(
        write_sources(tmp_path, 2, 2),
        tokenizer,
        seed=0,
        seq_len=64,
        batch_size=1,
        micro_batch_size=1,
        dp_rank=0,
        dp_size=1,
    )
    with pytest.raises(ValueError, match="did the data files change"):
        data.batch(Progress(data=DataPosition(0, 4)))
