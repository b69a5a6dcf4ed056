"""Batch sources: `source(state) -> batch` for update state.progress.step + 1 (a `BatchSource`;
not to be confused with a data source, one of data.sources). Side effects: `rl_source` generates
or waits for rollouts (through the handle in `state.handles.rollouts`); `sft_source` and
`pair_source` are pure given the state (their corpus was read once, into `state.handles.data`),
but for one all-reduce under torchrun. All three check every token id of the batch against the
model's vocabulary (`checked_token_ids`): this is the one place every batch of a training step
passes.

A source is called once per step by `fold` with the current state and reads only that state, so
it cannot run ahead of the fold: the batch for step N + 1 needs the state after step N. Calling a
source with a state that has already been stepped raises StaleStateError. Every source starts
exactly at `state.progress` (step and data position), so a resumed run sees the same batches as
an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from fnt.batch import BadToken, PairBatch, RLBatch, SftBatch, first_bad_token
from fnt.distributed.collectives import all_gather_objects, all_reduce_max
from fnt.errors import DataError
from fnt.state import TrainState

BatchSource = Callable[[TrainState], Any]
"""Any callable from the current state to the batch of the next update."""

Batch = TypeVar("Batch", SftBatch, RLBatch, PairBatch)


def sft_source(state: TrainState) -> SftBatch:
    """This rank's SFT batch for update state.progress.step + 1 (synthetic data, or the corpus
    of data.sources), from the state's data handle."""
    state.check_current()
    if state.handles.data is None:
        raise ValueError("the state holds no SFT data: build it from a Config with init_state")
    return checked_token_ids(state.handles.data.batch(state.progress), state, state.handles.data)


def pair_source(state: TrainState) -> PairBatch:
    """This rank's batch of preference pairs for update state.progress.step + 1 (a DPO run's
    data.sources), from the state's data handle."""
    state.check_current()
    if state.handles.data is None:
        raise ValueError("the state holds no pairs: build it from a DPOConfig with init_state")
    batch = state.handles.data.batch(state.progress)
    if not isinstance(batch, PairBatch):
        raise ValueError("the state's data are not pairs: build it from a DPOConfig")
    return checked_token_ids(batch, state, state.handles.data)


def rl_source(state: TrainState) -> RLBatch:
    """This rank's RL batch for update state.progress.step + 1, from the state's rollout handle
    (the in-process engine samples from the weights `state` holds; the external reader waits for
    the orchestrator's files)."""
    state.check_current()
    if state.handles.rollouts is None:
        raise ValueError(
            "the state holds no rollout engine: build it from an RLConfig with init_state"
        )
    rollouts = state.handles.rollouts
    return checked_token_ids(rollouts.rollout(state), state, rollouts)


def checked_token_ids(batch: Batch, state: TrainState, handle: Any) -> Batch:
    """`batch`, once every token id in it is a row of the model's input embedding; else a
    DataError, on every rank alike, before any rank starts the step: where the first bad id
    came from (`handle.locate(progress, bad)`: a data record, a cache entry, a rollout file and
    line; for a handle without `locate`, its place in the batch), the id and the vocabulary
    size. Every SFT, DPO and RL batch of a source passes here, whatever made its ids (a tokenizer
    larger than the model, a cache entry, an orchestrator's file, an environment), so an id
    never reaches the embedding, where it would be an IndexError on the CPU and a device-side
    assert on a GPU. Under torchrun one all-reduce of a flag per step, so that a rank whose
    share is good does not wait in the step for one that stopped."""
    runtime = state.handles.runtime
    vocab_size = input_vocabulary(state.handles.model)
    bad = None if vocab_size is None else first_bad_token(batch, vocab_size)
    found = bad is not None
    if runtime.distributed:
        found = bool(all_reduce_max([float(found)], runtime)[0])
    if not found:
        return batch
    message = None if bad is None else bad_token_message(bad, vocab_size, state, handle)
    raise DataError(next(m for m in all_gather_objects(message, runtime.distributed) if m))


def input_vocabulary(model: Any) -> Optional[int]:
    """The rows of the model's input embedding (None for a model without one, e.g. a research
    loop's own module, whose ids are then its own business)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    return getattr(embeddings, "num_embeddings", None)


def bad_token_message(bad: BadToken, vocab_size: int, state: TrainState, handle: Any) -> str:
    """The one line a bad token id is reported with."""
    step = state.progress.step + 1
    locate = getattr(handle, "locate", None)
    where = (
        locate(state.progress, bad)
        if locate is not None
        else f"update {step}'s batch, micro-batch {bad.micro_batch}, row {bad.row}, document "
        f"{bad.document}, token {bad.offset}"
    )
    return (
        f"{where}: token id {bad.token_id} is outside the model's vocabulary ({vocab_size} rows "
        f"in its input embedding, ids 0..{vocab_size - 1}); nothing of update {step} was trained"
    )
