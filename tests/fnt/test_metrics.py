"""Metric rows: one merged row per step, collisions raise, exactly one monitor call on rank 0."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.obs.metrics import (
    GIB,
    MetricCollision,
    disk_metrics,
    disk_metrics_from_usage,
    finite_or_none,
    merge_metrics,
    perf_metrics,
    step_row,
    to_floats,
)
from fnt.rows import RowBuilder
from tests.steps.test_sft import make_state

SETTINGS = settings(max_examples=150, deadline=None)

# Metric-like keys ("loss/mean", "progress/a/ratio_samples"); "step" and "time" belong to the row.
keys = st.text(alphabet="abcdefgh_/", min_size=1, max_size=10).filter(
    lambda k: k not in ("step", "time")
)
values = st.one_of(st.floats(allow_nan=False), st.integers(-(10**9), 10**9))


@st.composite
def disjoint_groups(draw, min_groups=0):
    """Groups of metrics whose keys are pairwise distinct."""
    all_keys = draw(st.lists(keys, unique=True, max_size=20))
    n = draw(st.integers(min_groups, 5))
    owners = [draw(st.integers(0, max(n - 1, 0))) for _ in all_keys] if n else []
    groups = [{} for _ in range(n)]
    for key, owner in zip(all_keys, owners):
        groups[owner][key] = draw(values)
    return groups


@SETTINGS
@given(disjoint_groups())
def test_merge_is_the_union(groups):
    row = merge_metrics(*groups)
    union = {k: v for g in groups for k, v in g.items()}
    assert row == union
    assert len(row) == sum(len(g) for g in groups)
    for g in groups:
        for k, v in g.items():
            assert row[k] is v


@SETTINGS
@given(disjoint_groups(min_groups=2), st.data())
def test_duplicated_key_raises(groups, data):
    nonempty = [i for i, g in enumerate(groups) if g]
    if not nonempty:
        groups[0]["loss/mean"] = 1.0
        nonempty = [0]
    src = data.draw(st.sampled_from(nonempty))
    dst = data.draw(st.sampled_from([i for i in range(len(groups)) if i != src]))
    key = data.draw(st.sampled_from(sorted(groups[src])))
    groups[dst][key] = data.draw(values)
    with pytest.raises(MetricCollision, match=re.escape(repr(key))):
        merge_metrics(*groups)
    with pytest.raises(MetricCollision):
        step_row(1, 0.0, *groups)


@SETTINGS
@given(st.integers(1, 10**6), st.floats(allow_nan=False), disjoint_groups())
def test_step_row_is_step_time_and_the_union(step, time, groups):
    row = step_row(step, time, *groups)
    assert row == {"step": step, "time": time, **{k: v for g in groups for k, v in g.items()}}
    assert row["step"] == step and row["time"] == time
    assert len(row) == 2 + sum(len(g) for g in groups)


@pytest.mark.parametrize("key", ["step", "time"])
def test_a_group_cannot_overwrite_step_or_time(key):
    """A group with a 'step' or 'time' key would silently replace the row's own value."""
    with pytest.raises(MetricCollision):
        step_row(5, 12.5, {"loss/mean": 1.0}, {key: 99})


def test_the_row_builder_makes_one_row_per_step_with_every_group(tiny_model_dir, tmp_path):
    """The driver's rows (fnt.rows): the step's metrics, progress/*, perf/*, the timing with
    time/save_ckpt of the save before, and system/*: one row per call, in order."""
    state = make_state(tiny_model_dir, output_dir=str(tmp_path))
    rows = RowBuilder(state)
    first = rows.row(state, {"loss/mean": torch.tensor(2.0)}, {"time/step": 0.5})
    assert first["step"] == 0 and first["loss/mean"] == 2.0 and first["time/save_ckpt"] == 0.0
    assert {"progress/num_tokens", "perf/throughput", "system/ckpt_disk_free_gib"} <= first.keys()
    rows.saved(1.25)
    second = rows.row(state, {"loss/mean": 1.0}, {"time/step": 0.5})
    assert second["time/save_ckpt"] == 1.25  # the save after the previous row
    assert rows.row(state, {}, {"time/step": 0.5})["time/save_ckpt"] == 0.0


def test_a_step_metric_that_a_loop_group_has_too_raises_instead_of_making_a_row(tiny_model_dir):
    state = make_state(tiny_model_dir)
    with pytest.raises(MetricCollision, match="time/step"):
        RowBuilder(state).row(state, {"time/step": 1.0}, {"time/step": 2.0})


# ---------------------------------------------------------------------------------------------
# The groups


@SETTINGS
@given(
    tokens=st.integers(0, 10**9),
    seconds=st.one_of(st.just(0.0), st.floats(1e-6, 1e4)),
    world=st.integers(1, 64),
    fpt=st.floats(0, 1e12),
    peak=st.one_of(st.just(0.0), st.floats(1e9, 1e16)),
    mem=st.floats(0, 1e3),
)
def test_perf_metrics(tokens, seconds, world, fpt, peak, mem):
    perf = perf_metrics(tokens, seconds, world, fpt, peak, mem)
    assert set(perf) == {
        "perf/throughput",
        "perf/throughput_per_rank",
        "perf/mfu",
        "perf/peak_memory",
    }
    assert all(math.isfinite(v) and v >= 0 for v in perf.values())
    if seconds > 0:
        assert perf["perf/throughput"] == tokens / seconds
    else:
        assert perf["perf/throughput"] == 0.0
    assert math.isclose(
        perf["perf/throughput_per_rank"] * world, perf["perf/throughput"], rel_tol=1e-12
    )
    if peak > 0:
        assert math.isclose(
            perf["perf/mfu"], perf["perf/throughput"] * fpt / world / peak, rel_tol=1e-9
        )
    assert perf["perf/peak_memory"] == mem


@SETTINGS
@given(st.integers(0, 2**50), st.data())
def test_disk_metrics_from_usage(total, data):
    used = data.draw(st.integers(0, total))
    free = total - used
    disk = disk_metrics_from_usage(total, used, free)
    assert disk["system/ckpt_disk_total_gib"] == total / GIB
    assert disk["system/ckpt_disk_used_gib"] == used / GIB
    assert disk["system/ckpt_disk_free_gib"] == free / GIB
    assert 0.0 <= disk["system/ckpt_disk_free_ratio"] <= 1.0


def test_disk_metrics_of_a_path_not_yet_created(tmp_path):
    disk = disk_metrics(tmp_path / "a" / "b" / "checkpoints")
    assert disk["system/ckpt_disk_total_gib"] > 0
    assert 0.0 <= disk["system/ckpt_disk_free_ratio"] <= 1.0


def test_to_floats_keeps_order_and_values():
    metrics = {
        "b": torch.tensor(2.5),
        "a": 1,
        "c": torch.tensor([3.0], dtype=torch.float64),
        "d": 0.5,
    }
    out = to_floats(metrics)
    assert list(out) == ["b", "a", "c", "d"]
    assert out == {"b": 2.5, "a": 1.0, "c": 3.0, "d": 0.5}
    assert all(type(v) is float for v in out.values())


@given(st.floats())
def test_finite_or_none(x):
    assert finite_or_none(x) == (x if math.isfinite(x) else None)
