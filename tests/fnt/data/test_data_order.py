"""The sample order is a pure function of (seed, epoch, cursor) that follows the weights."""

from __future__ import annotations

import math
from collections import Counter
from itertools import islice

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.batch import DataPosition
from fnt.data import SampleOrder, epoch_order, source_quotas

source_sizes = st.lists(st.integers(1, 30), min_size=1, max_size=4)
seeds = st.integers(0, 2**40)


@st.composite
def orders(draw) -> SampleOrder:
    sizes = draw(source_sizes)
    weights = draw(st.lists(st.floats(0.1, 10.0), min_size=len(sizes), max_size=len(sizes)))
    return SampleOrder(tuple(sizes), tuple(weights), seed=draw(seeds), shuffle=draw(st.booleans()))


@given(sizes=source_sizes, data=st.data())
def test_quotas_fill_the_epoch_and_are_within_one_of_the_weighted_share(sizes, data):
    weights = data.draw(st.lists(st.floats(0.01, 100.0), min_size=len(sizes), max_size=len(sizes)))
    quotas = source_quotas(sizes, weights)
    assert sum(quotas) == sum(sizes)
    for quota, weight in zip(quotas, weights):
        assert abs(quota - sum(sizes) * weight / sum(weights)) < 1


@given(order=orders(), epoch=st.integers(0, 6))
def test_the_same_seed_and_epoch_give_the_same_order_with_each_source_at_its_quota(order, epoch):
    first = epoch_order(
        order.source_sizes, order.weights, seed=order.seed, epoch=epoch, shuffle=order.shuffle
    )
    again = epoch_order(
        order.source_sizes, order.weights, seed=order.seed, epoch=epoch, shuffle=order.shuffle
    )
    assert torch.equal(first, again)
    ends = torch.tensor(order.source_sizes).cumsum(0)
    per_source = Counter(torch.bucketize(first, ends, right=True).tolist())
    quotas = source_quotas(order.source_sizes, order.weights)
    assert [per_source[s] for s in range(len(quotas))] == list(quotas)


def test_shuffling_gives_each_epoch_a_different_permutation_and_file_order_otherwise():
    shuffled = [
        SampleOrder((50,), (1.0,), seed=3, shuffle=True).epoch(e).tolist() for e in range(5)
    ]
    assert all(sorted(order) == list(range(50)) for order in shuffled)
    assert len({tuple(order) for order in shuffled}) == 5
    other_seed = SampleOrder((50,), (1.0,), seed=4, shuffle=True).epoch(0).tolist()
    assert other_seed != shuffled[0]
    in_file_order = SampleOrder((50,), (1.0,), seed=3, shuffle=False)
    assert all(in_file_order.epoch(e).tolist() == list(range(50)) for e in range(3))


@settings(max_examples=50)
@given(order=orders(), data=st.data())
def test_resuming_from_any_position_continues_exactly_like_running_through(order, data):
    epoch = data.draw(st.integers(0, 3))
    cursor = data.draw(st.integers(0, order.epoch_length - 1))
    steps = 2 * order.epoch_length + 3
    through = list(
        islice(order.iter_from(DataPosition()), (epoch * order.epoch_length + cursor) + steps)
    )
    resumed = list(islice(order.iter_from(DataPosition(epoch, cursor)), steps))
    assert resumed == through[-steps:]
    assert resumed[0][0] == DataPosition(epoch, cursor)


@given(order=orders(), epoch=st.integers(0, 4))
def test_every_prefix_of_an_epoch_holds_each_source_near_its_weight(order, epoch):
    n, num_sources = order.epoch_length, len(order.source_sizes)
    quotas = source_quotas(order.source_sizes, order.weights)
    ends = torch.tensor(order.source_sizes).cumsum(0)
    sources = torch.bucketize(order.epoch(epoch), ends, right=True)
    prefix = torch.arange(1, n + 1, dtype=torch.float64)
    for s, (quota, weight) in enumerate(zip(quotas, order.weights)):
        taken = (sources == s).cumsum(0).double()
        off_quota = (taken - prefix * quota / n).abs().max().item()
        assert off_quota <= (1 + num_sources * quota / n) / 2 + 1e-9
        if num_sources == 2:
            assert off_quota <= 0.5 + 1e-9
        # the quota is within one sample of the weighted share of the whole epoch
        off_weight = (taken - prefix * weight / math.fsum(order.weights)).abs().max().item()
        assert off_weight <= (1 + num_sources * quota / n) / 2 + 1 + 1e-9


@settings(max_examples=50)
@given(order=orders(), epochs=st.integers(1, 6))
def test_over_epochs_every_sample_of_a_source_is_seen_equally_often_within_one(order, epochs):
    seen = Counter(sample_id for e in range(epochs) for sample_id in order.epoch(e).tolist())
    first_id = 0
    for size, quota in zip(order.source_sizes, source_quotas(order.source_sizes, order.weights)):
        counts = [seen[i] for i in range(first_id, first_id + size)]
        assert max(counts) - min(counts) <= 1
        assert sum(counts) == epochs * quota
        first_id += size


def test_positions_outside_the_data_are_rejected():
    order = SampleOrder((3, 2), (1.0, 1.0), seed=0, shuffle=True)
    for bad in (DataPosition(0, 5), DataPosition(0, -1), DataPosition(-1, 0)):
        with pytest.raises(ValueError, match="outside the data: an epoch has 5 samples"):
            next(order.iter_from(bad))


@pytest.mark.parametrize(
    ("sizes", "weights", "message"),
    [
        ((), (), "at least one source"),
        ((2,), (1.0, 1.0), "one weight per source"),
        ((0,), (1.0,), "at least one sample"),
        ((2,), (0.0,), "> 0"),
        ((2,), (math.nan,), "> 0"),
    ],
)
def test_bad_sources_or_weights_are_rejected(sizes, weights, message):
    with pytest.raises(ValueError, match=message):
        SampleOrder(sizes, weights, seed=0, shuffle=True)
