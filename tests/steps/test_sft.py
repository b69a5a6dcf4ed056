"""sft_step on the tiny model: learning, accumulation equivalence, the stale-state guard."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fnt import fold, init_state
from fnt.batch import DataPosition, SftBatch
from fnt.config import Config, ModelConfig, OptimConfig
from fnt.data.synthetic import synthetic_rows, take_rows
from fnt.distributed.runtime import setup_trainer
from fnt.state import StaleStateError
from fnt.update import accumulate_gradients_
from steps.sft import sft_loss, sft_step


def make_state(model_dir, **overrides):
    config = Config(
        model=ModelConfig(name=str(model_dir)),
        optim=OptimConfig(lr=3e-3, max_norm=1.0),
        max_steps=20,
        seq_len=32,
        **overrides,
    )
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    return state


def batch_of(rows, micro_batch_size: int, num_samples: int = 4) -> SftBatch:
    n = rows.input_ids.shape[0]
    micro = tuple(take_rows(rows, i, i + micro_batch_size) for i in range(0, n, micro_batch_size))
    return SftBatch(micro_batches=micro, num_samples=num_samples, data_after=DataPosition())


def test_loss_falls_over_20_steps_on_a_fixed_batch(tiny_model_dir):
    state = make_state(tiny_model_dir)
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    batch = batch_of(rows, micro_batch_size=2)
    losses = []
    for state, metrics in fold(state, lambda _: batch, sft_step, 20):
        losses.append(float(metrics["loss/mean"]))
    assert state.progress.step == 20
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_micro_batches_give_the_full_batch_gradient(tiny_model_dir, k):
    state = make_state(tiny_model_dir)
    model, runtime = state.handles.model, state.handles.runtime
    rows, docs = synthetic_rows(seed=3, step=7, num_rows=4, seq_len=32)
    # The rows carry different numbers of loss tokens, so a per-micro-batch mean would differ.
    assert len(set(rows.loss_mask.sum(dim=1).tolist())) > 1

    def grads_for(micro_batch_size):
        model.zero_grad(set_to_none=True)
        totals = accumulate_gradients_(model, batch_of(rows, micro_batch_size), runtime, sft_loss)
        return totals, [p.grad.clone() for p in model.parameters()]

    full_totals, full = grads_for(4)
    acc_totals, acc = grads_for(4 // k)
    assert acc_totals.loss_tokens == full_totals.loss_tokens
    torch.testing.assert_close(acc_totals.loss_sum, full_totals.loss_sum, rtol=0, atol=1e-4)
    for g_full, g_acc in zip(full, acc):
        torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)


def without_loss(rows):
    return dataclasses.replace(rows, loss_mask=torch.zeros_like(rows.loss_mask))


@pytest.mark.parametrize("empty", [(1, 2), (2,), (0, 2)], ids=["tail2", "tail1", "head-tail"])
def test_trailing_micro_batches_without_loss_are_not_run(tiny_model_dir, empty):
    state = make_state(tiny_model_dir)
    model, runtime = state.handles.model, state.handles.runtime
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=6, seq_len=32)
    micro = [take_rows(rows, i, i + 2) for i in range(0, 6, 2)]
    micro = [without_loss(mb) if i in empty else mb for i, mb in enumerate(micro)]
    forwards = []
    model.lm_head.register_forward_hook(lambda *_: forwards.append(1))

    def grads_for(micro_batches):
        model.zero_grad(set_to_none=True)
        batch = SftBatch(tuple(micro_batches), num_samples=4, data_after=DataPosition())
        totals = accumulate_gradients_(model, batch, runtime, sft_loss)
        return totals, [p.grad.clone() for p in model.parameters()]

    totals, grads = grads_for(micro)
    last_with_loss = max(i for i in range(3) if i not in empty)
    assert len(forwards) == last_with_loss + 1  # an empty micro-batch before it still runs
    # The same gradients, bit for bit, as the micro-batches with loss tokens alone.
    ref_totals, ref = grads_for([mb for i, mb in enumerate(micro) if i not in empty])
    assert totals.loss_tokens == ref_totals.loss_tokens > 0
    assert totals.tokens == 6 * 32  # the skipped rows still count as processed tokens
    for g, g_ref in zip(grads, ref):
        assert torch.equal(g, g_ref)


def test_progress_counts_tokens_samples_and_data_position(tiny_model_dir):
    state = make_state(tiny_model_dir)
    rows, docs = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    batch = dataclasses.replace(
        batch_of(rows, 2, num_samples=sum(docs)), data_after=DataPosition(0, 9)
    )
    state, metrics = sft_step(state, batch)
    assert state.progress.step == 1
    assert state.progress.total_tokens == 4 * 32
    assert state.progress.total_samples == sum(docs)
    assert state.progress.data == DataPosition(0, 9)
    assert float(metrics["optim/lr"]) == pytest.approx(3e-3)
    assert float(metrics["loss/nan_count"]) == 0.0


def test_stepping_a_consumed_state_raises(tiny_model_dir):
    state = make_state(tiny_model_dir)
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=2, seq_len=32)
    batch = batch_of(rows, 2)
    sft_step(state, batch)
    with pytest.raises(StaleStateError, match="step 0"):
        sft_step(state, batch)


def three_step_losses(model_dir, **model_overrides):
    state = make_state(model_dir)
    config = dataclasses.replace(
        state.config, model=dataclasses.replace(state.config.model, **model_overrides)
    )
    state = init_state(config, state.handles.runtime)
    rows, _ = synthetic_rows(seed=1, step=1, num_rows=4, seq_len=32)
    batch = batch_of(rows, micro_batch_size=2)
    losses = []
    for state, metrics in fold(state, lambda _: batch, sft_step, 3):
        losses.append(float(metrics["loss/mean"]))
    return state, losses


def is_checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_activation_checkpointing_gives_the_same_losses(tiny_model_dir):
    plain_state, plain = three_step_losses(tiny_model_dir, ac=False)
    ac_state, with_ac = three_step_losses(tiny_model_dir, ac=True)
    assert is_checkpointing(ac_state.handles.model)
    assert not is_checkpointing(plain_state.handles.model)
    assert with_ac == pytest.approx(plain, abs=1e-6)


def test_bfloat16_model_trains(tiny_model_dir):
    state, losses = three_step_losses(tiny_model_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in state.handles.model.parameters())
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
