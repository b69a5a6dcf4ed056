"""rl_step on the tiny model: successor state and metrics, learning, accumulation equivalence."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

from fnt import fold, init_state
from fnt.batch import DataPosition, PackedRows, RLBatch, RLMicroBatch
from fnt.config import LoraConfig, ModelConfig, OptimConfig, RLConfig, RLLossConfig
from fnt.data.synthetic import take_rows
from fnt.distributed.collectives import all_reduce_sum, all_reduce_sums
from fnt.distributed.runtime import setup_trainer
from fnt.update import packed_logits
from steps.rl import rl_gradients_, rl_step

ROWS, T = 4, 32
# Different loss-token counts per row, so a per-micro-batch mean would differ from the global one.
PROMPT_LENGTHS = (8, 12, 16, 20)
ADVANTAGES = (1.0, -1.0, 1.0, -1.0)
TEMPERATURES = (1.0, 0.7, 1.3, 1.0)
RL_KEYS = {
    "loss/mean",
    "skipped/zero_advantage",
    "entropy/all/mean",
    "masked/high_fraction",
    "masked/low_fraction",
    "optim/grad_norm",
}
MISMATCH_KEYS = {"mismatch_kl/all/mean", "kl_ent_ratio/mean"}


def make_state(model_dir, lr=1e-2, loss=RLLossConfig(), lora=LoraConfig()):
    config = RLConfig(
        model=ModelConfig(name=str(model_dir), lora=lora),
        optim=OptimConfig(lr=lr, max_norm=1.0),
        max_steps=10,
        seq_len=T,
        loss=loss,
    )
    state = init_state(config, setup_trainer(config))
    return state


def random_rows(seed: int) -> PackedRows:
    """One prompt + completion per row; the completion (after the prompt) carries the loss."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (ROWS, T), generator=gen)
    positions = torch.arange(T).expand(ROWS, T).contiguous()
    loss_mask = positions >= torch.tensor(PROMPT_LENGTHS)[:, None]
    return PackedRows(input_ids, positions, torch.zeros_like(input_ids), loss_mask)


def per_row(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None].expand(ROWS, T).contiguous()


def own_logprobs(model, rows: PackedRows) -> torch.Tensor:
    """The model's logprobs [B, T] of each token at its row's temperature (0 at position 0)."""
    with torch.no_grad():
        logits = packed_logits(model, rows)[:, :-1] / per_row(TEMPERATURES)[:, 1:, None]
        lp = torch.log_softmax(logits, -1).gather(-1, rows.input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ROWS, 1), lp], dim=1)


def rl_batch(rows: PackedRows, inference_logprobs=None, size=ROWS) -> RLBatch:
    """The rows in micro-batches of `size` rows, with the per-row advantages and temperatures."""
    advantages, temperatures = per_row(ADVANTAGES), per_row(TEMPERATURES)

    def micro(lo, hi):
        part = take_rows(rows, lo, hi)
        inference = None if inference_logprobs is None else inference_logprobs[lo:hi]
        return RLMicroBatch(
            part, advantages[lo:hi], temperatures[lo:hi], inference, ((T,),) * (hi - lo)
        )

    return RLBatch(
        micro_batches=tuple(micro(i, i + size) for i in range(0, ROWS, size)),
        num_samples=ROWS,
        data_after=DataPosition(0, ROWS),
        metrics={"reward/mean": 0.5},
    )


def completion_logprob(model, rows: PackedRows, row: int) -> float:
    return float(own_logprobs(model, rows)[row][rows.loss_mask[row]].mean())


def test_on_policy_step_returns_the_successor_and_its_metrics(tiny_model_dir):
    state = make_state(tiny_model_dir)
    rows = random_rows(0)
    batch = rl_batch(rows, own_logprobs(state.handles.model, rows))
    state, metrics = rl_step(state, batch)

    assert state.progress.step == 1
    assert state.progress.total_samples == ROWS and state.progress.data == DataPosition(0, ROWS)
    assert RL_KEYS | MISMATCH_KEYS | {"reward/mean"} <= set(metrics)
    assert float(metrics["reward/mean"]) == 0.5
    # Inference logprobs equal to the trainer's: r = 1, so no mismatch, no masking, and the loss
    # is minus the mean advantage over the loss tokens of all rows.
    assert abs(float(metrics["mismatch_kl/all/mean"])) < 1e-5
    assert abs(float(metrics["kl_ent_ratio/mean"])) < 1e-5
    assert float(metrics["masked/high_fraction"]) == 0
    assert float(metrics["masked/low_fraction"]) == 0
    counts = [T - p for p in PROMPT_LENGTHS]
    expected = -sum(a * n for a, n in zip(ADVANTAGES, counts)) / sum(counts)
    assert float(metrics["loss/mean"]) == pytest.approx(expected, abs=1e-5)
    assert 0 < float(metrics["entropy/all/mean"]) <= math.log(state.handles.model.config.vocab_size)


def test_without_inference_logprobs_the_mismatch_metrics_are_absent(tiny_model_dir):
    state, metrics = rl_step(make_state(tiny_model_dir), rl_batch(random_rows(1)))
    assert state.progress.step == 1
    assert RL_KEYS <= set(metrics)
    assert not MISMATCH_KEYS & set(metrics)


def test_positive_advantage_completions_become_more_likely(tiny_model_dir):
    state = make_state(tiny_model_dir, lr=1e-2)
    model, rows = state.handles.model, random_rows(2)
    before = [completion_logprob(model, rows, r) for r in range(ROWS)]
    for state, _ in fold(state, lambda _: rl_batch(rows), rl_step, 4):
        pass
    after = [completion_logprob(model, rows, r) for r in range(ROWS)]
    for r, advantage in enumerate(ADVANTAGES):
        if advantage > 0:
            assert after[r] > before[r] + 0.1, (r, before, after)
        else:
            assert after[r] < before[r] - 0.1, (r, before, after)


@pytest.mark.parametrize(
    "kind, aggregation", [("ratio", "token"), ("ratio", "sequence"), ("gspo", "sequence")]
)
def test_micro_batches_of_one_row_give_the_full_batch_gradient(tiny_model_dir, kind, aggregation):
    loss_config = RLLossConfig(
        kind=kind,
        aggregation=aggregation,
        eps_low=0.2,
        eps_high=0.28,
        gspo_eps_low=0.05,
        gspo_eps_high=0.05,
        kl_tau=0.1,
    )
    state = make_state(tiny_model_dir, loss=loss_config)
    model, runtime = state.handles.model, state.handles.runtime
    rows = random_rows(3)
    # Off-policy enough that both masking rules and the penalty contribute.
    noise = 0.5 * torch.randn(ROWS, T, generator=torch.Generator().manual_seed(4))
    inference = own_logprobs(model, rows) + noise

    def grads_for(micro_batch_size):
        model.zero_grad(set_to_none=True)
        batch = rl_batch(rows, inference, micro_batch_size)
        totals = rl_gradients_(model, batch, runtime, loss_config, chunk_tokens=16)
        return totals, [p.grad.clone() for p in model.parameters()]

    full_totals, full = grads_for(ROWS)
    acc_totals, acc = grads_for(1)
    assert full_totals.sums["masked_high"] + full_totals.sums["masked_low"] > 0
    if aggregation == "sequence":  # one sample per row: the loss is the mean of their means
        assert full_totals.loss_denominator == ROWS
    torch.testing.assert_close(acc_totals.loss_sum, full_totals.loss_sum, rtol=0, atol=1e-4)
    for key, value in full_totals.sums.items():
        torch.testing.assert_close(acc_totals.sums[key], value, rtol=1e-5, atol=1e-4)
    for g_full, g_acc in zip(full, acc):
        torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)


def without_advantages(batch: RLBatch) -> RLBatch:
    zero = tuple(
        dataclasses.replace(mb, advantages=torch.zeros_like(mb.advantages))
        for mb in batch.micro_batches
    )
    return dataclasses.replace(batch, micro_batches=zero)


def test_a_step_with_only_zero_advantages_makes_no_update(tiny_model_dir):
    # Without the kl_tau penalty the loss is exactly 0 when every advantage is.
    state = make_state(tiny_model_dir, loss=RLLossConfig(kl_tau=0.0))
    model, rows = state.handles.model, random_rows(5)
    batch = rl_batch(rows, own_logprobs(model, rows))
    zero = without_advantages(batch).micro_batches
    before = [p.detach().clone() for p in model.parameters()]
    state, metrics = rl_step(state, dataclasses.replace(batch, micro_batches=zero))
    assert state.progress.step == 1 and state.progress.data == DataPosition(0, ROWS)
    assert float(metrics["skipped/zero_advantage"]) == 1.0
    assert float(metrics["optim/skipped"]) == 1.0
    assert math.isnan(float(metrics["loss/mean"]))
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
    # The next step, with advantages, trains as usual.
    state, metrics = rl_step(state, rl_batch(rows, own_logprobs(model, rows)))
    assert float(metrics["skipped/zero_advantage"]) == 0.0
    assert float(metrics["optim/skipped"]) == 0.0
    assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))


def test_an_rl_step_reduces_its_counts_once(tiny_model_dir, monkeypatch):
    """The step's counts and its zero-advantage decision share one all-reduce; the loss and
    metric sums are the other: two per step (a third used to count the batch again)."""
    state = make_state(tiny_model_dir)
    rows = random_rows(0)
    batch = rl_batch(rows, own_logprobs(state.handles.model, rows))
    reduced = []

    def counted(t, distributed):
        reduced.append(t.numel())
        return t

    def counted_values(values, runtime):
        reduced.append(len(values))
        return [float(v) for v in values]

    for module in list(sys.modules.values()):  # wherever the collectives were imported
        # A module's own names only: a module-level __getattr__ may import on any lookup
        # (transformers 5.17's *_fast aliases import their image processor, which needs
        # torchvision).
        names = getattr(module, "__dict__", {})
        if names.get("all_reduce_sum") is all_reduce_sum:
            monkeypatch.setattr(module, "all_reduce_sum", counted)
        if names.get("all_reduce_sums") is all_reduce_sums:
            monkeypatch.setattr(module, "all_reduce_sums", counted_values)
    rl_step(state, batch)
    assert len(reduced) == 2, reduced


@pytest.mark.parametrize(
    "loss",
    [
        RLLossConfig(kl_tau=0.1),  # the penalty on log r, with inference logprobs
        RLLossConfig(kind="custom", custom="tests.steps.test_rl_loss:length_weighted_loss"),
    ],
    ids=["kl_tau", "custom"],
)
def test_a_zero_advantage_step_trains_when_the_loss_has_a_signal_of_its_own(tiny_model_dir, loss):
    """Only a loss that is 0 with zero advantages makes the step skip (steps.rl_losses.
    zero_without_advantages): the kl_tau penalty pulls log r toward 0 off-policy, and a custom
    loss may not vanish at all."""
    state = make_state(tiny_model_dir, loss=loss)
    model, rows = state.handles.model, random_rows(5)
    inference = own_logprobs(model, rows) + 0.3  # a stale sampler: log r != 0
    before = [p.detach().clone() for p in model.parameters()]
    _, metrics = rl_step(state, without_advantages(rl_batch(rows, inference)))
    assert float(metrics["skipped/zero_advantage"]) == 0.0
    assert float(metrics["optim/skipped"]) == 0.0
    if loss.kind != "custom":  # the custom one is -A logp / |y|: 0 in gradient too
        assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
