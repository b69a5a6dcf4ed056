"""Learning-rate schedules: warmup ends, bounds, final rate and monotone decay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.config import ScheduleConfig
from fnt.schedule import lr_at

SETTINGS = settings(max_examples=200, deadline=None)
peaks = st.floats(min_value=1e-8, max_value=10.0)
kinds = st.sampled_from(["constant", "linear", "cosine"])


@st.composite
def schedules(draw):
    peak = draw(peaks)
    min_lr = draw(
        st.one_of(st.just(0.0), st.just(peak), st.floats(0.0, 1.0).map(lambda f: f * peak))
    )
    warmup = draw(st.integers(0, 30))
    max_steps = draw(st.integers(1, 300))
    return peak, ScheduleConfig(kind=draw(kinds), warmup_steps=warmup, min_lr=min_lr), max_steps


@SETTINGS
@given(schedules())
def test_bounds(sched):
    peak, schedule, max_steps = sched
    warmup = schedule.warmup_steps
    low = min(schedule.min_lr, peak / warmup) if warmup else schedule.min_lr
    for step in range(1, max_steps + 3):
        lr = lr_at(step, peak, schedule, max_steps)
        assert low <= lr <= peak, (step, lr)


@SETTINGS
@given(schedules())
def test_warmup_starts_at_peak_over_warmup_and_ends_at_peak(sched):
    peak, schedule, max_steps = sched
    warmup = schedule.warmup_steps
    if warmup == 0:
        assert lr_at(1, peak, schedule, max_steps) <= peak
        return
    assert lr_at(1, peak, schedule, max_steps) == peak / warmup
    assert lr_at(warmup, peak, schedule, max_steps) == peak
    rates = [lr_at(s, peak, schedule, max_steps) for s in range(1, warmup + 1)]
    assert rates == sorted(rates)


@SETTINGS
@given(schedules())
def test_final_rate_is_min_lr(sched):
    peak, schedule, max_steps = sched
    final = lr_at(max_steps, peak, schedule, max_steps)
    if max_steps > schedule.warmup_steps:
        assert final == (peak if schedule.kind == "constant" else schedule.min_lr)
    else:
        # The run ends inside warmup: the last step still uses its warmup rate.
        assert final == lr_at(
            max_steps, peak, ScheduleConfig(warmup_steps=schedule.warmup_steps), max_steps
        )


@SETTINGS
@given(schedules())
def test_after_warmup(sched):
    peak, schedule, max_steps = sched
    after = [
        lr_at(s, peak, schedule, max_steps) for s in range(schedule.warmup_steps + 1, max_steps + 3)
    ]
    if schedule.kind == "constant":
        assert all(lr == peak for lr in after)
    else:
        assert all(a >= b for a, b in zip(after, after[1:])), after
        # Past max_steps the rate stays at min_lr instead of rising again (cosine) or going below.
        if max_steps > schedule.warmup_steps:
            assert after[-1] == after[-2] == schedule.min_lr


@SETTINGS
@given(schedules(), st.integers(1, 400))
def test_lr_is_a_function_of_the_step(sched, step):
    """Resume derives the same rate: no hidden state between calls."""
    peak, schedule, max_steps = sched
    first = lr_at(step, peak, schedule, max_steps)
    for s in range(1, 5):
        lr_at(s, peak, schedule, max_steps)
    assert lr_at(step, peak, schedule, max_steps) == first


def test_examples():
    linear = ScheduleConfig(kind="linear", warmup_steps=2, min_lr=0.0)
    assert [lr_at(s, 1.0, linear, 6) for s in range(1, 7)] == [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = ScheduleConfig(kind="cosine", warmup_steps=0, min_lr=0.1)
    assert lr_at(1, 1.0, cosine, 3) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_at(2, 1.0, cosine, 3) == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr_at(3, 1.0, cosine, 3) == 0.1
    constant = ScheduleConfig(kind="constant", warmup_steps=4)
    assert [lr_at(s, 2.0, constant, 10) for s in (1, 2, 4, 5, 10)] == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_step_zero_is_rejected():
    with pytest.raises(ValueError, match="step"):
        lr_at(0, 1.0, ScheduleConfig(), 10)


def test_warmup_end_is_exactly_peak_example():
    """0.1 * 3 / 3 == 0.10000000000000002: the rate at the end of warmup overshoots the peak."""
    assert lr_at(3, 0.1, ScheduleConfig(warmup_steps=3), 10) == 0.1
