"""The RL loss family against an independent float64 per-token re-computation of the formulas in
steps/rl_losses.py: every loss kind, both aggregations, the reference KL and a custom loss, in
value and gradient; plus the masking rules, numerical safety and the metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.batch import PackedRows, RLMicroBatch, host_layout
from fnt.config import RLLossConfig
from fnt.model.lm_head import logprobs_from_logits, loss_tokens_of
from fnt.update import StepTotals
from steps.rl import SUM_KEYS, policy_loss, rl_loss, rl_metrics
from steps.rl_losses import (
    LossInputs,
    TokenLoss,
    aggregation_of,
    per_sample,
    token_loss,
)

V = 17
KINDS = ("dppo_tv", "ipo", "ratio", "gspo")
# GSPO's own bounds (3e-4 / 4e-4) mask nearly every sample of a random case; wider ones let the
# test see kept and masked samples alike.
CONFIGS = {
    "dppo_tv": RLLossConfig(kind="dppo_tv"),
    "ipo": RLLossConfig(kind="ipo"),
    "ratio": RLLossConfig(kind="ratio"),
    "gspo": RLLossConfig(kind="gspo", gspo_eps_low=0.2, gspo_eps_high=0.2),
}


def micro_batch(input_ids, positions, document_ids, loss_mask, advantages, temperatures, **extra):
    rows = PackedRows(input_ids, positions, document_ids, loss_mask)
    lengths = tuple(
        tuple(int((doc == d).sum()) for d in range(int(doc.max()))) for doc in document_ids
    )
    mb = RLMicroBatch(rows, advantages, temperatures, sample_lengths=lengths, **extra)
    mb.check()
    return mb


def random_case(seed: int, with_inference: bool, with_ref: bool = False, noise: float = 1.0):
    """Random logits and tokens in rows of two documents and a padding document, loss masks,
    advantages of both signs (one per document) and temperatures in [0.5, 1.5].

    Values at non-loss positions are hostile (temperature 0, NaN logprobs, huge advantages):
    RLMicroBatch.check allows them, so they must not reach the loss or its gradient.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 16
    logits = (2 * torch.randn(B, T, V, generator=gen)).requires_grad_()
    input_ids = torch.randint(0, V, (B, T), generator=gen)
    # Most targets are their logits' likeliest token, so probabilities near 1 (and the large
    # probability changes the dp masks look for) occur as in real samples.
    likeliest = torch.cat([input_ids[:, :1], logits.detach()[:, :-1].argmax(-1)], dim=1)
    input_ids = torch.where(torch.rand(B, T, generator=gen) < 0.6, likeliest, input_ids)
    positions, documents = (
        torch.zeros(B, T, dtype=torch.int64),
        torch.zeros(B, T, dtype=torch.int64),
    )
    advantages = torch.zeros(B, T)
    for b in range(B):
        first = int(torch.randint(3, 7, (), generator=gen))
        second = int(torch.randint(3, T - first, (), generator=gen))
        start = 0
        for d, n in enumerate((first, second, T - first - second)):
            positions[b, start : start + n] = torch.arange(n)
            documents[b, start : start + n] = d
            advantages[b, start : start + n] = float(torch.randn((), generator=gen))
            start += n
    loss_mask = (torch.rand(B, T, generator=gen) < 0.75) & (positions > 0) & (documents < 2)
    advantages = torch.where(loss_mask, advantages, 1e6)
    temperatures = torch.where(loss_mask, 0.5 + torch.rand(B, T, generator=gen), 0.0)
    scaled = logits.detach()[:, :-1] / temperatures[:, 1:, None].clamp_min(0.5)
    own = torch.log_softmax(scaled, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    def near_own(scale):
        moved = torch.cat(
            [torch.zeros(B, 1), own + scale * torch.randn(B, T - 1, generator=gen)], 1
        )
        return torch.where(loss_mask, moved.clamp_max(0.0), float("nan"))

    extra = {"inference_logprobs": near_own(noise) if with_inference else None}
    if with_ref:
        extra["ref_logprobs"] = near_own(0.7)
    mb = micro_batch(input_ids, positions, documents, loss_mask, advantages, temperatures, **extra)
    return logits, mb


# rollout.max_new_tokens: the constant aggregation's L in these cases (longer than any sample).
MAX_NEW_TOKENS = 24


def loss_of(logits, mb: RLMicroBatch, config: RLLossConfig):
    """rl_loss on the loss tokens' logprobs and entropies taken from full logits."""
    tokens = loss_tokens_of(mb.rows, mb.temperatures, entropy=True)
    return rl_loss(logprobs_from_logits(logits, tokens), mb, config, MAX_NEW_TOKENS)


def reference_tokens(logits, mb: RLMicroBatch):
    """The float64 leaf and, per loss token, its logp (on the leaf), q, ref, A, sample and H."""
    leaf = logits.detach().double().requires_grad_()
    B, T = mb.rows.input_ids.shape
    tokens = []
    for b in range(B):
        for t in range(1, T):
            if not mb.rows.loss_mask[b, t]:
                continue
            z = leaf[b, t - 1] / float(mb.temperatures[b, t])
            p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
            logp = torch.log(p[mb.rows.input_ids[b, t]])
            optional = {}
            for name in ("inference_logprobs", "ref_logprobs"):
                values = getattr(mb, name)
                optional[name] = None if values is None else float(values[b, t])
            tokens.append(
                {
                    "logp": logp,
                    "q": optional["inference_logprobs"],
                    "ref": optional["ref_logprobs"],
                    "a": float(mb.advantages[b, t]),
                    "sample": (b, int(mb.rows.document_ids[b, t])),
                    "entropy": float(-(p * torch.log(p)).sum().detach()),
                }
            )
    return leaf, tokens


def reference_token_loss(token, config: RLLossConfig, sample_log_ratio=None):
    """(l_t, masked high, masked low) of one token by the table of steps/rl_losses.py."""
    logp, q, a = token["logp"], token["q"], token["a"]
    log_r = logp - logp.detach() if q is None else logp - q
    dp = 0.0 if q is None else math.exp(float(logp.detach())) - math.exp(q)
    ratio = math.exp(float(log_r.detach()))
    if config.kind == "dppo_tv":
        high, low = a > 0 and dp > config.dppo_mask_high, a < 0 and dp < -config.dppo_mask_low
    elif config.kind == "ipo":
        masked = abs(dp) > config.ipo_threshold
        high, low = masked and dp > 0, masked and dp < 0
    elif config.kind == "ratio":
        high, low = a > 0 and ratio > 1 + config.eps_high, a < 0 and ratio < 1 - config.eps_low
    else:  # gspo: the sample's geometric-mean ratio
        s = math.exp(float(sample_log_ratio.detach()))
        high = a > 0 and s > 1 + config.gspo_eps_high
        low = a < 0 and s < 1 - config.gspo_eps_low
    loss = config.kl_tau * log_r**2
    if not (high or low):
        policy_ratio = torch.exp(sample_log_ratio if config.kind == "gspo" else log_r)
        loss = loss - a * policy_ratio
    return loss, high, low


def reference(logits, mb: RLMicroBatch, config: RLLossConfig, per_token=None):
    """The aggregated loss, its gradient on the logits and the metric sums, in float64.

    `per_token(tokens, config) -> [l_t or (l_t, high, low)]` replaces the kind's table (for a
    custom loss; a bare l_t masks nothing).
    """
    leaf, tokens = reference_tokens(logits, mb)
    by_sample: dict = {}
    for i, token in enumerate(tokens):
        by_sample.setdefault(token["sample"], []).append(i)
    stats = dict.fromkeys(SUM_KEYS, 0.0)
    losses, kept = [], []
    if per_token is not None:
        for out in per_token(tokens, config):
            loss, high, low = out if isinstance(out, tuple) else (out, False, False)
            losses.append(loss)
            kept.append(not (high or low))
    for i, token in enumerate(tokens):
        if per_token is None:
            members = by_sample[token["sample"]]
            log_ratios = [
                tokens[j]["logp"]
                - (tokens[j]["logp"].detach() if tokens[j]["q"] is None else tokens[j]["q"])
                for j in members
            ]
            loss, high, low = reference_token_loss(token, config, sum(log_ratios) / len(members))
            losses.append(loss)
            kept.append(not (high or low))
            stats["masked_high"] += high
            stats["masked_low"] += low
        if config.ref_kl_tau:
            delta = token["logp"] - token["ref"]
            # The importance weight r = pi / q of a kept token, a constant of the gradient.
            q = token["q"]
            weight = math.exp(float(token["logp"].detach()) - q) if q is not None and kept[i] else 1
            losses[i] = losses[i] + config.ref_kl_tau * weight * 0.5 * delta**2
            d = token["ref"] - float(token["logp"].detach())
            stats["ref_kl"] += math.exp(d) - d - 1
            stats["ref_kl_tokens"] += 1
        stats["entropy"] += token["entropy"]
        if token["q"] is not None:
            log_r = float(token["logp"].detach()) - token["q"]
            stats["mismatch_kl"] += math.exp(log_r) - log_r - 1
            stats["mismatch_tokens"] += 1
    # gspo's objective is a mean over samples whatever loss.aggregation says (GSPO's paper).
    aggregation = "sequence" if config.kind == "gspo" else config.aggregation
    if aggregation == "token":
        total = sum(losses)
    elif aggregation == "constant":  # Dr. GRPO: the division by S happens outside, as for N
        total = sum(losses) / MAX_NEW_TOKENS
    else:
        total = sum(sum(losses[j] for j in m) / len(m) for m in by_sample.values())
    total.backward()
    return total.detach(), leaf.grad, stats


def check_against_reference(logits, mb, config, per_token=None):
    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    ref_loss, ref_grad, ref_stats = reference(logits, mb, config, per_token)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert set(sums) == set(SUM_KEYS)
    for key in SUM_KEYS:
        assert float(sums[key]) == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-5), key
    return ref_stats


AGGREGATIONS = ("token", "sequence", "constant")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_kind_and_aggregation_matches_the_formulas(kind, aggregation, seed):
    config = dataclasses.replace(CONFIGS[kind], aggregation=aggregation, kl_tau=0.05)
    logits, mb = random_case(seed, with_inference=True)
    stats = check_against_reference(logits, mb, config)
    # The random case must exercise masking and keeping, or this test proves less than it says.
    assert stats["masked_high"] > 0 and stats["masked_low"] > 0
    assert stats["masked_high"] + stats["masked_low"] < stats["mismatch_tokens"]


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(KINDS),
    aggregation=st.sampled_from(AGGREGATIONS),
    with_inference=st.booleans(),
    kl_tau=st.sampled_from([0.0, 1e-3, 0.3]),
)
def test_random_cases_match_the_formulas(seed, kind, aggregation, with_inference, kl_tau):
    config = dataclasses.replace(CONFIGS[kind], aggregation=aggregation, kl_tau=kl_tau)
    logits, mb = random_case(seed, with_inference)
    check_against_reference(logits, mb, config)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_the_reference_kl_term_matches_the_formula(aggregation):
    config = RLLossConfig(ref_kl_tau=0.4, aggregation=aggregation)
    logits, mb = random_case(3, with_inference=True, with_ref=True)
    stats = check_against_reference(logits, mb, config)
    assert stats["ref_kl"] > 0 and stats["ref_kl_tokens"] == stats["mismatch_tokens"]


def clipped_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """A custom loss for the tests: PPO's clipped objective with the min, -min(r A, clip(r) A)."""
    ratio = torch.exp(inputs.log_ratio())
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
    loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return TokenLoss(
        loss, ratio.detach() > 1 + config.eps_high, ratio.detach() < 1 - config.eps_low
    )


def length_weighted_loss(inputs: LossInputs, config: RLLossConfig) -> torch.Tensor:
    """A custom loss returning a bare tensor: -A logp / |y_i| (REINFORCE, sample-normalized)."""
    counts = inputs.sample_token_counts()[inputs.sample_ids]
    return -inputs.advantages * inputs.logp / counts


def reference_clipped(tokens, config):
    out = []
    for token in tokens:
        r = torch.exp(token["logp"] - token["q"])
        clipped = torch.clamp(r, 1 - config.eps_low, 1 + config.eps_high)
        loss = -torch.minimum(r * token["a"], clipped * token["a"])
        ratio = float(r.detach())
        out.append((loss, ratio > 1 + config.eps_high, ratio < 1 - config.eps_low))
    return out


def reference_length_weighted(tokens, config):
    counts: dict = {}
    for token in tokens:
        counts[token["sample"]] = counts.get(token["sample"], 0) + 1
    return [-token["a"] * token["logp"] / counts[token["sample"]] for token in tokens]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(
    "name, per_token",
    [("clipped_loss", reference_clipped), ("length_weighted_loss", reference_length_weighted)],
)
def test_a_custom_loss_by_import_path(name, per_token, aggregation):
    config = RLLossConfig(
        kind="custom", custom=f"{__name__}:{name}", aggregation=aggregation, ref_kl_tau=0.2
    )
    logits, mb = random_case(4, with_inference=True, with_ref=True)
    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    ref_loss, ref_grad, ref_stats = reference(logits, mb, config, per_token)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert float(sums["ref_kl"]) == pytest.approx(ref_stats["ref_kl"], rel=1e-5)
    if name == "length_weighted_loss":  # a bare tensor masks nothing
        assert float(sums["masked_high"]) == 0 and float(sums["masked_low"]) == 0
    else:
        assert float(sums["masked_high"]) > 0


def test_sample_ids_number_the_documents_with_loss_tokens():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    layout = host_layout(documents.numpy(), loss_mask.numpy())
    ids, count = layout.loss_sample, layout.num_samples
    # Row-major loss tokens: row 0 doc 0 (two), row 0 doc 1, row 1 doc 1 (two); row 1 doc 0 has
    # no loss token and gets no number.
    assert ids.tolist() == [0, 0, 1, 2, 2] and count == 3


def one_row(logits, input_ids, advantages, ratios, temperature=0.8):
    """A micro-batch of one document whose loss tokens have the given ratios r = p / q."""
    T = input_ids.shape[1]
    logprobs = torch.log_softmax(logits.detach()[0, :-1] / temperature, -1)
    own = logprobs[torch.arange(T - 1), input_ids[0, 1:]]
    inference = torch.cat([torch.zeros(1), own - torch.as_tensor(ratios).log()])[None]
    positions = torch.arange(T)[None]
    return micro_batch(
        input_ids,
        positions,
        torch.zeros_like(input_ids),
        positions > 0,
        torch.tensor([[0.0, *advantages]]),
        torch.full((1, T), temperature),
        inference_logprobs=inference,
    )


def test_each_ratio_masking_rule():
    """Four loss tokens, past a bound in the advantage's direction (masked) or against it (kept)."""
    config = RLLossConfig(kind="ratio", eps_low=0.2, eps_high=0.28, kl_tau=0.0)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 5, V, generator=gen, requires_grad=True)
    input_ids = torch.randint(0, V, (1, 5), generator=gen)
    #                                 masked high  kept  masked low  kept
    mb = one_row(logits, input_ids, [1.0, -1.0, -1.0, 1.0], [1.5, 1.5, 0.5, 0.5])

    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    grad_norms = logits.grad[0, :-1].norm(dim=-1)  # row t-1 is the gradient of token t
    assert grad_norms[0] == 0 and grad_norms[2] == 0
    assert grad_norms[1] > 0 and grad_norms[3] > 0
    assert float(sums["masked_high"]) == 1.0 and float(sums["masked_low"]) == 1.0
    # The loss holds only the kept tokens: -A * r = 1.5 (A = -1, r = 1.5), -0.5 (A = 1, r = 0.5).
    assert loss.item() == pytest.approx(1.5 - 0.5, abs=1e-5)


def test_dppo_masks_on_the_probability_change_not_the_ratio():
    """A rare token may triple its probability and stay kept; a likely one that rises by 0.3 is
    masked, although its ratio (1.5) is smaller."""
    config = RLLossConfig(kind="dppo_tv", kl_tau=0.0)
    logits = torch.full((1, 3, V), -30.0)
    input_ids = torch.tensor([[0, 1, 2]])
    logits[0, 0, 1] = 0.0  # token 1 is certain at position 1
    logits[0, 1, 2] = 0.0
    logits[0, 1, 3] = math.log(99.0)  # token 2 has p = 0.01 at position 2
    logits.requires_grad_()
    p1, p2 = 1.0, 0.01
    ratios = [p1 / (p1 - 0.3), p2 / (p2 / 3)]  # dp = 0.3 (ratio 1.43) and dp = 0.0067 (ratio 3)
    mb = one_row(logits, input_ids, [1.0, 1.0], ratios, temperature=1.0)
    loss, sums = loss_of(logits, mb, config)
    assert float(sums["masked_high"]) == 1.0 and float(sums["masked_low"]) == 0.0
    assert loss.item() == pytest.approx(-3.0, rel=1e-4)  # only the rare token: -A r = -3


@pytest.mark.parametrize("kind", ["dppo_tv", "ratio", "ipo"])
def test_a_masked_token_with_an_overflowing_ratio_has_a_finite_gradient(kind):
    """log r = 100 > 88.7 overflows exp in float32; the token is masked, so neither its loss nor
    its gradient may carry inf or NaN (before the fix: loss -1, gradient [nan, ...])."""
    config = RLLossConfig(kind=kind, kl_tau=0.0)
    logits = torch.zeros(1, 3, V)
    logits[0, 0, 1] = 5.0  # p(token 1) ~ 0.9: its probability rose by far more than 0.2
    logits.requires_grad_()
    input_ids = torch.tensor([[0, 1, 2]])
    logprobs = torch.log_softmax(logits.detach()[0, :-1], -1)
    own = logprobs[torch.arange(2), input_ids[0, 1:]]
    inference = torch.cat([torch.zeros(1), own - torch.tensor([100.0, 0.0])])[None]
    positions = torch.arange(3)[None]
    mb = micro_batch(
        input_ids,
        positions,
        torch.zeros_like(input_ids),
        positions > 0,
        torch.tensor([[0.0, 1.0, 1.0]]),
        torch.ones(1, 3),
        inference_logprobs=inference,
    )
    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    assert float(sums["masked_high"]) == 1.0
    assert loss.item() == pytest.approx(-1.0, abs=1e-5)  # the kept token: -A r = -1
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0].abs().max() == 0  # the masked token's row


def test_masked_tokens_keep_the_penalty_gradient():
    """With kl_tau > 0 a masked token's gradient is exactly that of kl_tau * (log r)^2."""
    kl_tau, temp = 0.5, 1.2
    config = RLLossConfig(kind="ratio", eps_low=0.2, eps_high=0.28, kl_tau=kl_tau)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 2, V, generator=gen, requires_grad=True)
    input_ids = torch.randint(0, V, (1, 2), generator=gen)
    log_r = math.log(2.0)  # r = 2 with A > 0: masked high
    mb = one_row(logits, input_ids, [1.0], [2.0], temperature=temp)

    loss, sums = loss_of(logits, mb, config)
    loss.backward()
    assert float(sums["masked_high"]) == 1.0
    probs = torch.softmax(logits.detach()[0, 0] / temp, -1)
    d_logp = (torch.nn.functional.one_hot(input_ids[0, 1], V) - probs) / temp
    torch.testing.assert_close(logits.grad[0, 0], 2 * kl_tau * log_r * d_logp, rtol=1e-4, atol=1e-6)
    assert loss.item() == pytest.approx(kl_tau * log_r**2, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_without_inference_logprobs_the_gradient_is_reinforce(kind):
    config = dataclasses.replace(CONFIGS[kind], kl_tau=0.7)  # the penalty is 0 without them
    logits, mb = random_case(3, with_inference=False)
    loss, sums = loss_of(logits, mb, config)
    loss.backward()

    # With r = 1 in value every kind's gradient is -A d logp per token; GSPO's sample ratio,
    # in its sequence objective, gives each of the sample's |y_i| tokens -A d logp / |y_i|.
    expected = torch.zeros_like(logits)
    B, T = mb.rows.input_ids.shape
    mask, documents = mb.rows.loss_mask, mb.rows.document_ids
    for b in range(B):
        for t in range(1, T):
            if mask[b, t]:
                temp = float(mb.temperatures[b, t])
                probs = torch.softmax(logits.detach()[b, t - 1] / temp, -1)
                d_logp = (torch.nn.functional.one_hot(mb.rows.input_ids[b, t], V) - probs) / temp
                length = int((mask[b] & (documents[b] == documents[b, t])).sum())
                weight = 1 / length if kind == "gspo" else 1
                expected[b, t - 1] = -float(mb.advantages[b, t]) * d_logp * weight
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
        "ref_kl": 0.5,
        "ref_kl_tokens": 10.0,
    }
    sums = {key: torch.tensor(value) for key, value in values.items()}
    metrics = rl_metrics(totals_of(sums, loss_tokens=10.0))
    assert float(metrics["entropy/all/mean"]) == pytest.approx(0.8)
    assert float(metrics["masked/high_fraction"]) == pytest.approx(0.1)
    assert float(metrics["masked/low_fraction"]) == pytest.approx(0.3)
    assert float(metrics["mismatch_kl/all/mean"]) == pytest.approx(0.1)
    assert float(metrics["kl_ent_ratio/mean"]) == pytest.approx(0.1 / 0.8)
    assert float(metrics["ref_kl/mean"]) == pytest.approx(0.05)


def test_a_step_without_finite_micro_batches_reports_nan_not_zero():
    metrics = rl_metrics(totals_of({}, loss_tokens=10.0))
    assert math.isnan(float(metrics["entropy/all/mean"]))
    assert math.isnan(float(metrics["masked/high_fraction"]))
    assert "mismatch_kl/all/mean" not in metrics and "ref_kl/mean" not in metrics


# Issue-level checks of the formulas' sources ---------------------------------------------------


def two_samples(lengths=(2, 6), advantages=(1.0, 1.0), shift=(0.3, -0.2)):
    """LossInputs of two samples of the given lengths, each token's log ratio its sample's
    shift (so s_i = exp(shift_i)), with a leaf logp to differentiate."""
    sample_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    q = -1.0 - 0.1 * torch.arange(len(sample_ids), dtype=torch.float32)
    logp = (q + torch.tensor(shift)[sample_ids]).requires_grad_()
    inputs = LossInputs(
        logp=logp,
        inference_logprobs=q,
        ref_logprobs=None,
        advantages=torch.tensor(advantages)[sample_ids],
        sample_ids=sample_ids,
        num_samples=len(lengths),
    )
    return inputs, logp


def test_gspo_is_the_papers_sequence_objective_whatever_the_aggregation():
    """GSPO (Zheng et al. 2025): J = mean over samples of A_i s_i, s_i the geometric mean of
    the token ratios, so d J / d logp_t = A_i s_i / |y_i| for each token of sample i: a token of
    a 2-token sample weighs three times one of a 6-token sample, not the same."""
    for aggregation in ("token", "sequence", "constant"):
        config = RLLossConfig(kind="gspo", kl_tau=0.0, aggregation=aggregation)
        config = dataclasses.replace(config, gspo_eps_low=1.0, gspo_eps_high=1.0)  # no masking
        inputs, logp = two_samples()
        loss, _ = policy_loss(inputs, config, MAX_NEW_TOKENS)
        loss.backward()
        s = torch.exp(torch.tensor([0.3, -0.2]))
        assert float(loss.detach()) == pytest.approx(float(-(s[0] + s[1])), rel=1e-6)
        want = torch.cat([torch.full((2,), -float(s[0]) / 2), torch.full((6,), -float(s[1]) / 6)])
        torch.testing.assert_close(logp.grad, want, rtol=1e-6, atol=0)
        assert per_sample(aggregation_of(config))  # fnt.update then divides by the samples


def test_the_constant_aggregation_is_dr_grpos_fixed_normaliser():
    """Dr. GRPO (Liu et al. 2025) divides the token sum by a constant, samples x the maximum
    completion length, so no token's weight depends on the lengths in its batch."""
    config = RLLossConfig(kind="ratio", kl_tau=0.0, aggregation="constant")
    inputs, logp = two_samples(advantages=(1.0, -1.0), shift=(0.0, 0.0))
    loss, _ = policy_loss(inputs, config, MAX_NEW_TOKENS)
    loss.backward()
    # r = 1: l_t = -A_t, and the micro-batch's share is their sum over L (S divides outside).
    assert float(loss.detach()) == pytest.approx((-2 + 6) / MAX_NEW_TOKENS)
    torch.testing.assert_close(logp.grad, -inputs.advantages / MAX_NEW_TOKENS)
    assert per_sample("constant") and not per_sample("token")


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
def test_the_reference_kl_gradient_is_unbiased_on_and_off_policy(off_policy):
    """An exact categorical case: one prefix, V tokens. The expected gradient of the reference
    KL term over tokens drawn from the sampler q equals the gradient of KL(pi || pi_ref)
    itself: with q = pi (on-policy) and with q another distribution, through the importance
    weight."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), 0)
    logp_all = torch.log_softmax(theta, 0)
    sampler = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), 0)
    q = sampler if off_policy else logp_all.detach()
    config = RLLossConfig(kind="dppo_tv", kl_tau=0.0, ref_kl_tau=1.0)
    expected = torch.zeros(V, dtype=torch.float64)
    for x in range(V):  # E_{x ~ q}[gradient of the term for the sampled token x]
        inputs = LossInputs(
            logp=logp_all[x : x + 1],
            inference_logprobs=q[x : x + 1],
            ref_logprobs=ref[x : x + 1],
            advantages=torch.zeros(1, dtype=torch.float64),
            sample_ids=torch.zeros(1, dtype=torch.int64),
            num_samples=1,
        )
        loss = token_loss(inputs, config).loss.sum()
        (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
        expected += q[x].exp() * grad
    kl = (logp_all.exp() * (logp_all - ref)).sum()
    (want,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected, want, rtol=1e-9, atol=1e-12)
