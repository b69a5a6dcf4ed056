"""Batch sources: `source(state) -> batch` for update state.progress.step + 1 (a `BatchSource`;
not to be confused with a data source, one of data.sources). Side effects: `rl_source` generates
or waits for rollouts (through the handle in `state.handles.rollouts`); `sft_source` is pure
given the state (its corpus was read once, into `state.handles.data`).

A source is called once per step by `fold` with the current state and reads only that state, so
it cannot run ahead of the fold: the batch for step N + 1 needs the state after step N. Calling a
source with a state that has already been stepped raises StaleStateError. Every source starts
exactly at `state.progress` (step and data position), so a resumed run sees the same batches as
an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Callable

from fnt.batch import RLBatch, SftBatch
from fnt.state import TrainState

BatchSource = Callable[[TrainState], Any]
"""Any callable from the current state to the batch of the next update."""


def sft_source(state: TrainState) -> SftBatch:
    """This rank's SFT batch for update state.progress.step + 1 (synthetic data, or the corpus
    of data.sources), from the state's data handle."""
    state.check_current()
    if state.handles.data is None:
        raise ValueError("the state holds no SFT data: build it from a Config with init_state")
    return state.handles.data.batch(state.progress)


def rl_source(state: TrainState) -> RLBatch:
    """This rank's RL batch for update state.progress.step + 1, from the state's rollout handle
    (the in-process engine samples from the weights `state` holds; the external reader waits for
    the orchestrator's files)."""
    state.check_current()
    if state.handles.rollouts is None:
        raise ValueError(
            "the state holds no rollout engine: build it from an RLConfig with init_state"
        )
    return state.handles.rollouts.rollout(state)
