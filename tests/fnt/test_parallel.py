"""Rank slicing: the one rule every batch source uses to give each rank its share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fnt.distributed.parallel import rank_bounds, rank_share


@given(items=st.lists(st.integers(), max_size=24), dp=st.integers(1, 4))
def test_rank_shares_partition_a_step_in_order(items, dp):
    items = items[: len(items) - len(items) % dp]
    shares = [rank_share(items, r, dp, what="items") for r in range(dp)]
    assert [x for share in shares for x in share] == items
    assert len({len(share) for share in shares}) == 1
    bounds = [rank_bounds(len(items), r, dp, what="items") for r in range(dp)]
    assert [tuple(items[lo:hi]) for lo, hi in bounds] == shares


def test_a_step_that_does_not_split_over_the_ranks_names_what_it_splits():
    with pytest.raises(ValueError, match="6 prompts per step do not split evenly over 4"):
        rank_share(list(range(6)), 0, 4, what="prompts per step")
