"""Greedy step plans, packed rows and the step's data metrics."""

from __future__ import annotations

from itertools import islice

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from fnt.batch import DataPosition
from fnt.data import SampleOrder, pack_rows, plan_step, step_metrics
from fnt.data.order import source_quotas

SEQ_LEN = 16


@st.composite
def planned_streams(draw):
    """Sample lengths per source (0: dropped), weights, seed, shuffle, start cursor, batch size."""
    lengths = draw(
        st.lists(
            st.lists(st.one_of(st.just(0), st.integers(2, SEQ_LEN)), min_size=1, max_size=12),
            min_size=1,
            max_size=3,
        )
    )
    if all(length == 0 for source in lengths for length in source):
        lengths[0][0] = SEQ_LEN
    weights = tuple(draw(st.floats(0.5, 2.0)) for _ in lengths)
    start = DataPosition(draw(st.integers(0, 2)), draw(st.integers(0, sum(map(len, lengths)) - 1)))
    return (
        lengths,
        weights,
        draw(st.integers(0, 99)),
        draw(st.booleans()),
        start,
        draw(st.integers(1, 5)),
    )


def drawable(lengths, weights) -> bool:
    """Whether some source with a share of the epoch above 0 has a usable sample."""
    quotas = source_quotas([len(source) for source in lengths], weights)
    return any(quota and any(source) for source, quota in zip(lengths, quotas))


def build(make_corpus, stream):
    lengths, weights, seed, shuffle, start, batch_size = stream
    assume(drawable(lengths, weights))  # else plan_step refuses (tested below)
    corpus = make_corpus(lengths)
    order = SampleOrder(corpus.source_sizes, weights, seed=seed, shuffle=shuffle)
    return corpus, order, start, batch_size


@pytest.mark.parametrize(
    "lengths, weights, quotas",
    [
        # Source 0's share of a 2-sample epoch is 2 * 0.5 / 2.5 = 0.4, which rounds to 0.
        ([[SEQ_LEN], [0]], (0.5, 2.0), (0, 2)),
        ([[0, 0], [SEQ_LEN], [0, 0, 0]], (1.0, 0.1, 1.0), (3, 0, 3)),
    ],
)
def test_an_order_that_never_draws_a_usable_sample_is_refused_not_looped_over(
    make_corpus, lengths, weights, quotas
):
    corpus = make_corpus(lengths)
    order = SampleOrder(corpus.source_sizes, weights, seed=0, shuffle=True)
    assert source_quotas(order.source_sizes, order.weights) == quotas
    with pytest.raises(ValueError, match="no sample the data order draws is usable"):
        plan_step(order, DataPosition(1, 1), corpus.length, seq_len=SEQ_LEN, batch_size=2)


@given(planned_streams())
def test_a_plan_fills_batch_size_rows_greedily_with_the_samples_of_the_order(make_corpus, stream):
    corpus, order, start, batch_size = build(make_corpus, stream)
    plan = plan_step(order, start, corpus.length, seq_len=SEQ_LEN, batch_size=batch_size)
    assert len(plan.rows) == batch_size
    fills = [sum(corpus.length(i) for i in row) for row in plan.rows]
    assert all(row and fill <= SEQ_LEN for row, fill in zip(plan.rows, fills))
    # greedy: a row ends only because the next sample does not fit it
    for r in range(batch_size - 1):
        assert fills[r] + corpus.length(plan.rows[r + 1][0]) > SEQ_LEN
    # the plan consumed exactly the order from start up to data_after, in order
    distance = (
        (plan.data_after.epoch - start.epoch) * order.epoch_length
        + plan.data_after.cursor
        - start.cursor
    )
    consumed = [sample_id for _, sample_id in islice(order.iter_from(start), distance + 1)]
    next_sample = consumed.pop()
    assert fills[-1] + corpus.length(next_sample) > SEQ_LEN
    assert [i for i in consumed if corpus.length(i)] == [i for row in plan.rows for i in row]
    assert [i for i in consumed if not corpus.length(i)] == list(plan.skipped)


@given(planned_streams())
def test_packed_rows_keep_documents_apart_and_target_only_their_targets(make_corpus, stream):
    corpus, order, start, batch_size = build(make_corpus, stream)
    plan = plan_step(order, start, corpus.length, seq_len=SEQ_LEN, batch_size=batch_size)
    rows = pack_rows(
        [[corpus.tokens(i) for i in row] for row in plan.rows], seq_len=SEQ_LEN, pad_token_id=999
    )
    rows.check()
    assert rows.input_ids.shape == (batch_size, SEQ_LEN)
    for r, row in enumerate(plan.rows):
        at = 0
        for d, sample_id in enumerate(row):
            ids, targets = corpus.tokens(sample_id)
            span = slice(at, at + len(ids))
            assert torch.equal(rows.input_ids[r, span], ids)
            assert torch.equal(rows.loss_mask[r, span], targets)
            assert rows.position_ids[r, span].tolist() == list(range(len(ids)))
            assert (rows.document_ids[r, span] == d).all()
            at += len(ids)
        pad = slice(at, SEQ_LEN)
        assert (rows.input_ids[r, pad] == 999).all() and not rows.loss_mask[r, pad].any()
        assert rows.position_ids[r, pad].tolist() == list(range(SEQ_LEN - at))
        assert (rows.document_ids[r, pad] == len(row)).all()


def test_a_row_longer_than_seq_len_is_rejected():
    too_long = (torch.ones(5, dtype=torch.int64), torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not fit seq_len=8"):
        pack_rows([[too_long, too_long]], seq_len=8, pad_token_id=0)


def test_step_metrics_count_fates_and_measure_sources_tokens_and_padding(make_corpus):
    # source s0: samples 0 (len 4), 1 (dropped); source s1: samples 2 (len 6), 3 (len 2)
    corpus = make_corpus([[4, 0], [6, 2]])
    order = SampleOrder(corpus.source_sizes, (1.0, 1.0), seed=0, shuffle=False)
    plan = plan_step(order, DataPosition(), corpus.length, seq_len=8, batch_size=2)
    assert plan.rows == ((0,), (2, 3)) and plan.skipped == (1,)
    assert plan.data_after == DataPosition(1, 0)
    assert step_metrics(plan, corpus, seq_len=8) == {
        "data/truncated": 0.0,
        "data/dropped_overlong": 0.0,
        "data/dropped_no_loss": 1.0,
        "data/dropped_bad": 0.0,
        "data/num_samples": 3.0,
        "data/num_tokens": 12.0,
        "data/loss_tokens": 3.0 + 5.0 + 1.0,
        "data/pad_fraction": 1 - 12 / 16,
        "progress/s0/ratio_samples": 1 / 3,
        "progress/s0/ratio_tokens": 4 / 12,
        "progress/s1/ratio_samples": 2 / 3,
        "progress/s1/ratio_tokens": 8 / 12,
    }


def test_one_source_has_no_ratio_metrics(make_corpus):
    corpus = make_corpus([[4, 4, 4]])
    order = SampleOrder(corpus.source_sizes, (1.0,), seed=0, shuffle=False)
    plan = plan_step(order, DataPosition(), corpus.length, seq_len=8, batch_size=1)
    assert not [key for key in step_metrics(plan, corpus, seq_len=8) if key.startswith("progress/")]
