"""The pure decisions of process setup: parallel plan, expert parallelism, threads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.config import ConfigError, ParallelConfig
from fnt.config.parallel import ParallelDims, plan_parallel_dims, resolve_ep
from fnt.distributed.runtime import threads_per_rank
from fnt.model.moe import num_experts_of

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(replicate=st.integers(1, 8), shard=st.integers(1, 8))
def test_product_equal_to_world_size_is_accepted(replicate, shard):
    world = replicate * shard
    dims = plan_parallel_dims(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world, 1)
    assert dims == ParallelDims(replicate, shard, 1, 1, 1)
    assert dims.world_size == world and dims.dp == world


@SETTINGS
@given(replicate=st.integers(1, 8), world=st.integers(1, 64))
def test_dp_shard_minus_one_fills_the_world(replicate, world):
    parallel = ParallelConfig(dp_replicate=replicate, dp_shard=-1)
    if world % replicate == 0:
        dims = plan_parallel_dims(parallel, world, 1)
        assert dims.dp_shard == world // replicate
        assert dims.world_size == world and dims.dp == world
    else:
        with pytest.raises(ConfigError) as info:
            plan_parallel_dims(parallel, world, 1)
        assert "dp_replicate" in str(info.value) and str(world) in str(info.value)


@SETTINGS
@given(replicate=st.integers(1, 8), shard=st.integers(1, 8), world=st.integers(1, 64))
def test_mismatched_product_is_rejected(replicate, shard, world):
    parallel = ParallelConfig(dp_replicate=replicate, dp_shard=shard)
    if replicate * shard == world:
        assert plan_parallel_dims(parallel, world, 1).world_size == world
        return
    with pytest.raises(ConfigError) as info:
        plan_parallel_dims(parallel, world, 1)
    msg = str(info.value)
    assert f"dp_shard={shard}" in msg and f"dp_replicate={replicate}" in msg and str(world) in msg


@SETTINGS
@given(
    name=st.sampled_from(["cp", "tp"]),
    degree=st.integers(2, 8),
    replicate=st.integers(1, 4),
    shard=st.integers(1, 4),
)
def test_cp_and_tp_above_one_are_rejected_by_name(name, degree, replicate, shard):
    world = replicate * shard * degree
    parallel = ParallelConfig(dp_replicate=replicate, dp_shard=shard, **{name: degree})
    with pytest.raises(ConfigError, match=rf"'parallel\.{name}' = {degree}"):
        plan_parallel_dims(parallel, world, 1)
    # With dp_shard = -1 the product matches by construction and the same rule fires.
    filled = ParallelConfig(dp_replicate=replicate, dp_shard=-1, **{name: degree})
    with pytest.raises(ConfigError, match=rf"'parallel\.{name}'"):
        plan_parallel_dims(filled, world, 1)


@SETTINGS
@given(ep=st.integers(2, 16), world=st.integers(1, 16))
def test_ep_above_one_is_rejected_by_name(ep, world):
    with pytest.raises(ConfigError, match=rf"'parallel\.ep' = {ep}"):
        plan_parallel_dims(ParallelConfig(), world, ep)


@pytest.mark.parametrize(
    "parallel, key",
    [
        (ParallelConfig(dp_replicate=0), "'parallel.dp_replicate'"),
        (ParallelConfig(cp=0), "'parallel.cp'"),
        (ParallelConfig(tp=-1), "'parallel.tp'"),
        (ParallelConfig(dp_shard=0), "'parallel.dp_shard'"),
        (ParallelConfig(dp_shard=-2), "'parallel.dp_shard'"),
    ],
)
def test_degrees_below_one_are_rejected_by_name(parallel, key):
    with pytest.raises(ConfigError) as info:
        plan_parallel_dims(parallel, 4, 1)
    assert key in str(info.value)


# ---------------------------------------------------------------------------------------------
# resolve_ep


@SETTINGS
@given(experts=st.one_of(st.none(), st.integers(1, 256)), world=st.integers(1, 64))
def test_auto_and_one_resolve_to_one(experts, world):
    assert resolve_ep("auto", experts, world) == 1
    assert resolve_ep(1, experts, world) == 1


@SETTINGS
@given(ep=st.integers(2, 16), experts=st.integers(1, 64), world=st.integers(1, 64))
def test_explicit_ep_must_divide_experts_and_world(ep, experts, world):
    if experts % ep == 0 and world % ep == 0:
        assert resolve_ep(ep, experts, world) == ep
    else:
        with pytest.raises(ConfigError, match=r"'parallel\.ep'"):
            resolve_ep(ep, experts, world)


@pytest.mark.parametrize("ep", [0, -1, "two", "AUTO", 1.5])
def test_bad_ep_values(ep):
    with pytest.raises(ConfigError, match=r"'parallel\.ep'"):
        resolve_ep(ep, 8, 8)


def test_ep_on_a_dense_model():
    with pytest.raises(ConfigError, match="no experts"):
        resolve_ep(2, None, 2)


# ---------------------------------------------------------------------------------------------
# threads_per_rank, num_experts_of


@SETTINGS
@given(cpus=st.integers(0, 512), local=st.integers(0, 64))
def test_threads_per_rank_is_a_fair_share(cpus, local):
    threads = threads_per_rank(cpus, local)
    assert threads >= 1
    ranks = max(1, local)
    if cpus >= ranks:
        assert threads * ranks <= cpus < (threads + 1) * ranks
    else:
        assert threads == 1


@pytest.mark.parametrize(
    "attrs, expected",
    [
        ({}, None),
        ({"num_experts": 8}, 8),
        ({"num_local_experts": 4}, 4),
        ({"n_routed_experts": 64}, 64),
        ({"num_experts": 0, "num_local_experts": 4}, 4),
        ({"num_experts": None}, None),
        ({"num_experts": 8, "n_routed_experts": 64}, 8),
        ({"num_experts_per_tok": 2}, None),
    ],
)
def test_num_experts_of(attrs, expected):
    assert num_experts_of(SimpleNamespace(**attrs)) == expected
