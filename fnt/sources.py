"""Batch sources: `source(state) -> batch` for update state.progress.step + 1 (a `BatchSource`;
not to be confused with a data source, one of data.sources). Side effects: `rl_source` generates
or waits for rollouts (through the handle in `state.handles.rollouts`); `sft_source` and
`pair_source` are pure given the state (their corpus was read once, into `state.handles.data`).

A source is called once per step by `fold` with the current state and reads only that state, so
it cannot run ahead of the fold: the batch for step N + 1 needs the state after step N. Calling a
source with a state that has already been stepped raises StaleStateError. Every source starts
exactly at `state.progress` (step and data position), so a resumed run sees the same batches as
an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Callable

from fnt.batch import PairBatch, RLBatch, SftBatch
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


def pair_source(state: TrainState) -> PairBatch:
    """This rank's batch of preference pairs for update state.progress.step + 1 (a DPO run's
    data.sources), from the state's data handle."""
    state.check_current()
    if state.handles.data is None:
        raise ValueError("the state holds no pairs: build it from a DPOConfig with init_state")
    batch = state.handles.data.batch(state.progress)
    if not isinstance(batch, PairBatch):
        raise ValueError("the state's data are not pairs: build it from a DPOConfig")
    return batch


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
