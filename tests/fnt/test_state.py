"""Progress round-trips through JSON; a consumed TrainState cannot be stepped again."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.batch import DataPosition
from fnt.config import Config
from fnt.state import Handles, Progress, StaleStateError, StepCursor, TrainState

SETTINGS = settings(max_examples=150, deadline=None)
counts = st.integers(min_value=0, max_value=2**62)
positions = st.builds(DataPosition, epoch=counts, cursor=counts)
progresses = st.builds(
    Progress, step=counts, total_tokens=counts, total_samples=counts, data=positions
)


@SETTINGS
@given(progresses)
def test_progress_json_round_trip(progress):
    text = progress.to_json()
    back = Progress.from_json(text)
    assert back == progress
    assert type(back.data) is DataPosition
    assert back.to_json() == text
    plain = json.loads(text)
    assert plain["data"] == {"epoch": progress.data.epoch, "cursor": progress.data.cursor}
    assert plain["step"] == progress.step


@SETTINGS
@given(progresses)
def test_progress_sorted_json_round_trip(progress):
    """The checkpoint writes `to_json(sort_keys=True)`; that form must read back too."""
    assert Progress.from_json(progress.to_json(sort_keys=True)) == progress


def test_progress_defaults_round_trip():
    assert Progress.from_json(Progress().to_json()) == Progress()
    assert Progress().data == DataPosition(0, 0)


def fresh_state(step: int = 0) -> TrainState:
    handles = Handles(model=None, optimizer=None, runtime=None, cursor=StepCursor(step))
    return TrainState(config=Config(), progress=Progress(step=step), handles=handles)


def test_advance_produces_the_successor():
    state = fresh_state()
    state.check_current()
    nxt = state.advance(total_tokens=128, total_samples=3, data=DataPosition(0, 3))
    assert nxt.progress == Progress(
        step=1, total_tokens=128, total_samples=3, data=DataPosition(0, 3)
    )
    assert nxt.handles is state.handles and nxt.config is state.config
    assert state.progress == Progress()  # the old record did not change
    nxt.check_current()


def test_advancing_a_consumed_state_raises():
    state = fresh_state()
    state.advance()
    with pytest.raises(StaleStateError):
        state.advance()
    with pytest.raises(StaleStateError):
        state.check_current()


@SETTINGS
@given(st.integers(0, 10**6), st.lists(st.integers(0, 10**6), min_size=1, max_size=8), st.data())
def test_only_the_newest_state_is_current(start, tokens, data):
    states = [fresh_state(start)]
    for t in tokens:
        states.append(states[-1].advance(total_tokens=states[-1].progress.total_tokens + t))
    assert [s.progress.step for s in states] == list(range(start, start + len(tokens) + 1))
    assert states[-1].progress.total_tokens == sum(tokens)
    states[-1].check_current()
    old = data.draw(st.sampled_from(states[:-1]))
    with pytest.raises(StaleStateError) as info:
        old.check_current()
    assert str(old.progress.step) in str(info.value)
    with pytest.raises(StaleStateError):
        old.advance()
    # The failed attempt did not move the cursor: the newest state still steps.
    states[-1].check_current()
    assert states[-1].advance().progress.step == start + len(tokens) + 1


def test_cursor_out_of_step_with_progress_is_stale():
    handles = Handles(model=None, optimizer=None, runtime=None, cursor=StepCursor(3))
    state = TrainState(config=Config(), progress=Progress(step=2), handles=handles)
    with pytest.raises(StaleStateError):
        state.check_current()
    with pytest.raises(StaleStateError):
        state.advance()
    assert handles.cursor.step == 3


def test_records_are_frozen():
    state = fresh_state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.progress = Progress(step=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.progress.step = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.handles.model = object()


@pytest.mark.parametrize("changes", [{"no_such_field": 1}, {"step": 7}])
def test_a_failed_advance_does_not_consume_the_state(changes):
    """advance() either returns the successor or raises and leaves the state current."""
    state = fresh_state()
    with pytest.raises(TypeError):
        state.advance(**changes)
    state.check_current()
    assert state.advance().progress.step == 1
