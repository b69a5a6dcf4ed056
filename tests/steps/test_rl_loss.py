"""The RL loss against an independent per-token re-computation of the formulas in steps/rl.py."""

from __future__ import annotations

import math

import pytest
import torch

from fnt.batch import PackedRows, RLMicroBatch
from fnt.config import RLLossConfig
from fnt.lm_head import logprobs_from_logits, loss_tokens_of
from fnt.update import StepTotals
from steps.rl import SUM_KEYS, rl_loss, rl_metrics

V = 17


def micro_batch(input_ids, loss_mask, advantages, temperatures, inference=None) -> RLMicroBatch:
    B, T = input_ids.shape
    positions = torch.arange(T).expand(B, T).contiguous()
    rows = PackedRows(input_ids, positions, torch.zeros_like(input_ids), loss_mask)
    mb = RLMicroBatch(rows, advantages, temperatures, inference, tuple((T,) for _ in range(B)))
    mb.check()
    return mb


def random_case(seed: int, with_inference: bool):
    """Random logits, tokens, masks, advantages of both signs and temperatures in [0.5, 1.5].

    Values at non-loss positions are hostile (temperature 0, NaN logprobs, huge advantages):
    RLMicroBatch.check allows them, so they must not reach the loss or its gradient.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T = 3, 12
    logits = (2 * torch.randn(B, T, V, generator=gen)).requires_grad_()
    input_ids = torch.randint(0, V, (B, T), generator=gen)
    loss_mask = torch.rand(B, T, generator=gen) < 0.7
    loss_mask[:, 0] = False
    advantages = torch.where(loss_mask, torch.randn(B, T, generator=gen), 1e6)
    temperatures = torch.where(loss_mask, 0.5 + torch.rand(B, T, generator=gen), 0.0)
    inference = None
    if with_inference:
        # Near the trainer's own logprobs, spread enough that both bounds get crossed.
        scaled = logits.detach()[:, :-1] / temperatures[:, 1:, None].clamp_min(0.5)
        own = torch.log_softmax(scaled, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        noise = 0.4 * torch.randn(B, T - 1, generator=gen)
        noisy = torch.cat([torch.zeros(B, 1), own + noise], dim=1)
        inference = torch.where(loss_mask, noisy, float("nan"))
    return logits, micro_batch(input_ids, loss_mask, advantages, temperatures, inference)


def loss_of(logits, mb: RLMicroBatch, config: RLLossConfig):
    """rl_loss on the loss tokens' logprobs and entropies taken from full logits."""
    tokens = loss_tokens_of(mb.rows, mb.temperatures, entropy=True)
    return rl_loss(logprobs_from_logits(logits, tokens), mb, config)


def reference(logits, mb: RLMicroBatch, config: RLLossConfig):
    """The module docstring's formulas, token by token, in float64 on a separate leaf."""
    leaf = logits.detach().double().requires_grad_()
    B, T = mb.rows.input_ids.shape
    loss = torch.zeros((), dtype=torch.float64)
    stats = dict.fromkeys(SUM_KEYS, 0.0)
    for b in range(B):
        for t in range(1, T):
            if not mb.rows.loss_mask[b, t]:
                continue
            z = leaf[b, t - 1] / float(mb.temperatures[b, t])
            p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
            logp = torch.log(p[mb.rows.input_ids[b, t]])
            a = float(mb.advantages[b, t])
            if mb.inference_logprobs is None:
                log_r = logp - logp.detach()
            else:
                log_r = logp - float(mb.inference_logprobs[b, t])
            r = torch.exp(log_r)
            ratio = float(r.detach())
            high = a > 0 and ratio > 1 + config.eps_high
            low = a < 0 and ratio < 1 - config.eps_low
            if not (high or low):
                loss = loss - a * r
            loss = loss + config.kl_tau * log_r**2
            stats["entropy"] += float(-(p * torch.log(p)).sum().detach())
            stats["masked_high"] += high
            stats["masked_low"] += low
            if mb.inference_logprobs is not None:
                stats["mismatch_kl"] += ratio - float(log_r.detach()) - 1
                stats["mismatch_tokens"] += 1
    loss.backward()
    return loss.detach(), leaf.grad, stats


@pytest.mark.parametrize("kl_tau", [0.0, 0.3])
@pytest.mark.parametrize("with_inference", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_the_formulas(seed, with_inference, kl_tau):
    config = RLLossConfig(eps_low=0.2, eps_high=0.28, kl_tau=kl_tau)
    logits, mb = random_case(seed, with_inference)
    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    ref_loss, ref_grad, ref_stats = reference(logits, mb, config)

    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert set(sums) == set(SUM_KEYS)
    for key in SUM_KEYS:
        assert float(sums[key]) == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-5), key
    if with_inference:
        # The random case must exercise both masking rules, or this test proves less than it says.
        assert ref_stats["masked_high"] > 0 and ref_stats["masked_low"] > 0


def test_each_masking_rule():
    """Four loss tokens, past a bound in the advantage's direction (masked) or against it (kept)."""
    config = RLLossConfig(eps_low=0.2, eps_high=0.28, kl_tau=0.0)
    gen = torch.Generator().manual_seed(5)
    T = 5
    logits = torch.randn(1, T, V, generator=gen, requires_grad=True)
    input_ids = torch.randint(0, V, (1, T), generator=gen)
    loss_mask = torch.tensor([[False, True, True, True, True]])
    temperatures = torch.full((1, T), 0.8)
    #                                masked high  kept  masked low  kept
    advantages = torch.tensor([[0.0, 1.0, -1.0, -1.0, 1.0]])
    ratios = torch.tensor([1.0, 1.5, 1.5, 0.5, 0.5])
    logprobs = torch.log_softmax(logits.detach()[0, :-1] / 0.8, -1)
    own = logprobs[torch.arange(T - 1), input_ids[0, 1:]]
    inference = torch.cat([torch.zeros(1), own - ratios[1:].log()])[None]
    mb = micro_batch(input_ids, loss_mask, advantages, temperatures, inference)

    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    grad_norms = logits.grad[0, :-1].norm(dim=-1)  # row t-1 is the gradient of token t
    assert grad_norms[0] == 0 and grad_norms[2] == 0
    assert grad_norms[1] > 0 and grad_norms[3] > 0
    assert float(sums["masked_high"]) == 1.0 and float(sums["masked_low"]) == 1.0
    # The loss holds only the kept tokens: -A * r = 1.5 (A = -1, r = 1.5), -0.5 (A = 1, r = 0.5).
    assert loss.item() == pytest.approx(1.5 - 0.5, abs=1e-5)


def test_masked_tokens_keep_the_penalty_gradient():
    """With kl_tau > 0 a masked token's gradient is exactly that of kl_tau * (log r)^2."""
    kl_tau, temp = 0.5, 1.2
    config = RLLossConfig(eps_low=0.2, eps_high=0.28, kl_tau=kl_tau)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 2, V, generator=gen, requires_grad=True)
    input_ids = torch.randint(0, V, (1, 2), generator=gen)
    probs = torch.softmax(logits.detach()[0, 0] / temp, -1)
    log_r = math.log(2.0)  # r = 2 with A > 0: masked high
    inference = torch.tensor([[0.0, float(probs[input_ids[0, 1]].log()) - log_r]])
    mb = micro_batch(
        input_ids,
        torch.tensor([[False, True]]),
        torch.tensor([[0.0, 1.0]]),
        torch.full((1, 2), temp),
        inference,
    )

    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    assert float(sums["masked_high"]) == 1.0
    d_logp = (torch.nn.functional.one_hot(input_ids[0, 1], V) - probs) / temp
    torch.testing.assert_close(logits.grad[0, 0], 2 * kl_tau * log_r * d_logp, rtol=1e-4, atol=1e-6)
    assert loss.item() == pytest.approx(kl_tau * log_r**2, rel=1e-5)


def test_without_inference_logprobs_the_gradient_is_reinforce():
    config = RLLossConfig(kl_tau=0.7)  # the penalty is 0 in value and gradient without them
    logits, mb = random_case(3, with_inference=False)
    loss, sums = loss_of(logits, mb, config)
    loss.backward()

    expected = torch.zeros_like(logits)
    B, T = mb.rows.input_ids.shape
    for b in range(B):
        for t in range(1, T):
            if mb.rows.loss_mask[b, t]:
                temp = float(mb.temperatures[b, t])
                probs = torch.softmax(logits.detach()[b, t - 1] / temp, -1)
                d_logp = (torch.nn.functional.one_hot(mb.rows.input_ids[b, t], V) - probs) / temp
                expected[b, t - 1] = -float(mb.advantages[b, t]) * d_logp
    torch.testing.assert_close(logits.grad, expected, rtol=1e-4, atol=1e-6)
    assert float(sums["masked_high"]) == 0 and float(sums["masked_low"]) == 0
    assert float(sums["mismatch_tokens"]) == 0

    metrics = rl_metrics(totals_of(sums, loss_tokens=float(mb.rows.loss_mask.sum())))
    assert "mismatch_kl/all/mean" not in metrics and "kl_ent_ratio/mean" not in metrics
    assert {"entropy/all/mean", "masked/high_fraction", "masked/low_fraction"} <= set(metrics)


def totals_of(sums, loss_tokens: float) -> StepTotals:
    zero = torch.zeros(())
    return StepTotals(zero, zero, dict(sums), loss_tokens, samples=1.0, tokens=1.0, moe_stats=None)


def test_metrics_divide_by_their_own_counts():
    values = {
        "entropy": 8.0,
        "masked_high": 1.0,
        "masked_low": 3.0,
        "mismatch_kl": 0.6,
        "mismatch_tokens": 6.0,
    }
    sums = {key: torch.tensor(value) for key, value in values.items()}
    metrics = rl_metrics(totals_of(sums, loss_tokens=10.0))
    assert float(metrics["entropy/all/mean"]) == pytest.approx(0.8)
    assert float(metrics["masked/high_fraction"]) == pytest.approx(0.1)
    assert float(metrics["masked/low_fraction"]) == pytest.approx(0.3)
    assert float(metrics["mismatch_kl/all/mean"]) == pytest.approx(0.1)
    assert float(metrics["kl_ent_ratio/mean"]) == pytest.approx(0.1 / 0.8)


def test_a_step_without_finite_micro_batches_reports_nan_not_zero():
    metrics = rl_metrics(totals_of({}, loss_tokens=10.0))
    assert math.isnan(float(metrics["entropy/all/mean"]))
    assert math.isnan(float(metrics["masked/high_fraction"]))
    assert "mismatch_kl/all/mean" not in metrics
