"""Batch sources: `source(state) -> batch` for update state.progress.step + 1. Side effects:
`rl_source` generates or waits for rollouts (through the handle in `state.handles.rollouts`);
`sft_source` is pure given the state (its JSONL corpus was read once, into `state.handles.data`).

A source is called once per step by `fold` with the current state and reads only that state, so
it cannot run ahead of the fold: the batch for step N + 1 needs the state after step N. Calling a
source with a state that has already been stepped raises StaleStateError. Every source starts
exactly at `state.progress` (step and data position), so a resumed run sees the same batches as
an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Callable

from fnt.batch import RLBatch, SftBatch
from fnt.data.synthetic import synthetic_batch
from fnt.state import TrainState

Source = Callable[[TrainState], Any]


def sft_source(state: TrainState) -> SftBatch:
    """This rank's SFT batch for update state.progress.step + 1 (synthetic or JSONL data)."""
    state.check_current()
    config, runtime = state.config, state.handles.runtime
    if config.data.kind == "synthetic":
        return synthetic_batch(
            seed=config.seed,
            step=state.progress.step + 1,
            start=state.progress.data,
            batch_size=config.batch_size,
            micro_batch_size=config.micro_batch_size,
            seq_len=config.seq_len,
            dp_rank=runtime.dp_rank,
            dp_size=runtime.dims.dp,
        )
    if state.handles.data is None:
        raise ValueError(
            "data.kind = 'jsonl' but the state holds no corpus: build it with init_state"
        )
    return state.handles.data.batch(state.progress.data)


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
