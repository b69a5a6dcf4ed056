"""loss.is_correction (steps/rl_losses.py): hand-computed weights of each correction at each
level, every kind x correction x level x aggregation against an independent float64
re-computation from logits, "none" bit-identical to the loss without the keys, the config's
checks, and the step's loss/is_* metrics (declared from the config, read back nowhere)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fnt.config import ConfigError, RLConfig, RLLossConfig, RolloutConfig, load_config, validate
from fnt.config.losses import IS_CORRECTIONS, IS_LEVELS
from steps.rl import SUM_KEYS, rl_gradients_, rl_metrics, rl_step
from steps.rl_losses import LossInputs, is_weights, token_loss
from tests.steps import test_rl_loss as formulas
from tests.steps import test_rl_step as rl
from tests.steps.test_host_reads import step_reads

F64 = torch.float64
# A kind that masks nothing here: what is left is the correction alone.
NO_MASK = {"kind": "ratio", "eps_low": 100.0, "eps_high": 100.0, "kl_tau": 0.0}


def inputs_with_ratios(ratios, samples, advantages=None) -> LossInputs:
    """Float64 LossInputs whose loss tokens have the importance ratios rho_t = p / q given, in
    the samples given (one id per token), with a leaf logp."""
    ratios = torch.tensor(ratios, dtype=F64)
    q = -1.0 - 0.25 * torch.arange(len(ratios), dtype=F64)
    sample_ids = torch.tensor(samples)
    return LossInputs(
        logp=(q + ratios.log()).requires_grad_(),
        inference_logprobs=q,
        ref_logprobs=None,
        advantages=torch.ones(len(ratios), dtype=F64) if advantages is None else advantages,
        sample_ids=sample_ids,
        num_samples=int(sample_ids.max()) + 1,
    )


def loss_and_grad(inputs: LossInputs, config: RLLossConfig):
    out = token_loss(inputs, config)
    (grad,) = torch.autograd.grad(out.loss.sum(), inputs.logp)
    return out, grad


# Hand-computed: token ratios 0.25, 1, 3, 8 in one sample; and a sample of ratios 2, 1.5
# (product 3) beside one of 0.5, 0.5, 0.5 (product 0.125). A = 1, so l_t = -w_t and d/dlogp_t
# = -w_t.
TOKENS = ([0.25, 1.0, 3.0, 8.0], [0, 0, 0, 0])
SEQUENCES = ([2.0, 1.5, 0.5, 0.5, 0.5], [0, 0, 1, 1, 1])
HAND = [
    # correction, level, case, weight per token, clipped units, masked units
    ("tis", "token", TOKENS, [0.25, 1.0, 2.0, 2.0], [0, 0, 1, 1], [0, 0, 0, 0]),
    ("mis", "token", TOKENS, [0.0, 1.0, 3.0, 0.0], [0, 0, 0, 0], [1, 0, 0, 1]),
    ("tis", "sequence", SEQUENCES, [2.0, 2.0, 0.125, 0.125, 0.125], [1, 0], [0, 0]),
    ("mis", "sequence", SEQUENCES, [3.0, 3.0, 0.0, 0.0, 0.0], [0, 0], [0, 1]),
]


@pytest.mark.parametrize("correction, level, case, weights, clipped, masked", HAND)
def test_hand_computed_weights(correction, level, case, weights, clipped, masked):
    """tis caps at is_cap = 2; mis (bounds [0.5, 5]) keeps a ratio inside with its value and
    drops one outside; the sequence level weighs each token by its sample's product."""
    config = RLLossConfig(**NO_MASK, is_correction=correction, is_level=level)
    assert (config.is_cap, config.is_bounds) == (2.0, (0.5, 5.0))
    inputs = inputs_with_ratios(*case)
    out, grad = loss_and_grad(inputs, config)
    want = torch.tensor(weights, dtype=F64)
    torch.testing.assert_close(out.loss.detach(), -want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, -want, rtol=1e-12, atol=1e-12)
    assert out.correction.clipped.tolist() == [bool(c) for c in clipped]
    assert out.correction.masked.tolist() == [bool(m) for m in masked]
    assert not out.correction.token_weight.requires_grad


def test_without_a_correction_the_same_cases_weigh_by_the_full_ratio():
    for case in (TOKENS, SEQUENCES):
        inputs = inputs_with_ratios(*case)
        out, grad = loss_and_grad(inputs, RLLossConfig(**NO_MASK))
        ratios = torch.tensor(case[0], dtype=F64)
        torch.testing.assert_close(grad, -ratios, rtol=1e-12, atol=1e-12)
        assert out.correction is None


def test_the_sequence_product_of_a_long_sample_neither_overflows_nor_loses_its_bound():
    """4000 tokens of ratio 1.05: the product is e^195 (past float32's range) and the mean
    per-token log ratio is tiny; tis caps it at is_cap exactly, mis drops it."""
    n = 4000
    q = torch.full((n,), -2.0)
    inputs = LossInputs(
        logp=(q + math.log(1.05)).requires_grad_(),
        inference_logprobs=q,
        ref_logprobs=None,
        advantages=torch.ones(n),
        sample_ids=torch.zeros(n, dtype=torch.int64),
        num_samples=1,
    )
    for correction, weight in (("tis", 2.0), ("mis", 0.0)):
        config = RLLossConfig(**NO_MASK, is_correction=correction, is_level="sequence")
        out, grad = loss_and_grad(inputs, config)
        assert torch.isfinite(grad).all() and torch.isfinite(out.loss).all()
        assert torch.equal(out.correction.token_weight, torch.full((n,), weight))


def test_mis_keeps_what_is_inside_its_bounds_and_a_lower_bound_of_zero_keeps_small_ratios():
    inputs = inputs_with_ratios([0.5001, 4.999, 0.4999, 1e-30, 5.001], [0, 0, 0, 0, 0])
    config = RLLossConfig(**NO_MASK, is_correction="mis", is_bounds=(0.5, 5.0))
    assert is_weights(inputs, config).masked.tolist() == [False, False, True, True, True]
    config = dataclasses.replace(config, is_bounds=(0.0, 5.0))
    assert is_weights(inputs, config).masked.tolist() == [False, False, False, False, True]


@pytest.mark.parametrize("kind", formulas.KINDS)
def test_none_is_bit_identical_to_the_loss_without_a_correction(kind):
    """With is_correction = "none" the kinds run exactly the code they ran before the
    correction existed (no weight, inputs.is_weight None), whatever the other is_* keys say."""
    base = dataclasses.replace(formulas.CONFIGS[kind], kl_tau=0.05, ref_kl_tau=0.3)
    logits, mb = formulas.random_case(4, with_inference=True, with_ref=True)
    (loss, sums), grad = backward(logits, mb, base)
    for others in ({"is_level": "sequence"}, {"is_cap": 1.5}, {"is_bounds": (0.1, 9.0)}):
        (other, other_sums), other_grad = backward(logits, mb, dataclasses.replace(base, **others))
        assert torch.equal(loss, other) and torch.equal(grad, other_grad)
        assert all(torch.equal(sums[k], other_sums[k]) for k in SUM_KEYS)
    assert all(float(sums[k]) == 0 for k in ("is_weight", "is_clipped", "is_masked", "is_units"))


def backward(logits, mb, config):
    logits = logits.detach().clone().requires_grad_()
    loss, sums = formulas.loss_of(logits, mb, config)
    loss.backward()
    return (loss.detach(), sums), logits.grad


@pytest.mark.parametrize("kind", [kind for kind in formulas.KINDS if kind != "gspo"])
def test_a_correction_that_changes_no_weight_trains_as_none(kind):
    """At the token level, tis with a cap above every ratio and mis with bounds around every
    ratio weigh by the full ratio r_t: their gradient is that of no correction (the loss's
    value differs only by rounding, as w exp(log r - sg(log r)) = r). Not gspo: a correction
    replaces the value of its geometric-mean sample ratio s_i by w (module docstring)."""
    base = dataclasses.replace(formulas.CONFIGS[kind], kl_tau=0.05)
    logits, mb = formulas.random_case(5, with_inference=True, noise=0.3)
    _, want = backward(logits, mb, base)
    wide = {"tis": {"is_cap": 1e30}, "mis": {"is_bounds": (0.0, 1e30)}}
    for correction, settings in wide.items():
        config = dataclasses.replace(base, is_correction=correction, **settings)
        (_, sums), grad = backward(logits, mb, config)
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)
        assert float(sums["is_clipped"]) == 0 and float(sums["is_masked"]) == 0


# The float64 reference ------------------------------------------------------------------------


def reference_weight(log_rho: float, config: RLLossConfig) -> tuple[float, bool, bool]:
    """(w, clipped, masked) of one unit's log ratio, by the table of steps/rl_losses.py."""
    if config.is_correction == "tis":
        return min(math.exp(log_rho), config.is_cap), log_rho > math.log(config.is_cap), False
    low, high = config.is_bounds
    inside = low <= math.exp(log_rho) <= high
    return (math.exp(log_rho) if inside else 0.0), False, not inside


def reference(logits, mb, config: RLLossConfig):
    """The aggregated loss, its gradient on the logits and the is_* sums, in float64, with
    the kinds' masks from test_rl_loss's table."""
    leaf, tokens = formulas.reference_tokens(logits, mb)
    by_sample: dict = {}
    for i, token in enumerate(tokens):
        by_sample.setdefault(token["sample"], []).append(i)
    stats = {key: 0.0 for key in ("is_weight", "is_clipped", "is_masked", "is_units")}
    weights = {}
    if config.is_level == "sequence":
        for sample, members in by_sample.items():
            log_rho = sum(float(tokens[j]["logp"].detach()) - tokens[j]["q"] for j in members)
            w, clipped, masked = reference_weight(log_rho, config)
            weights.update(dict.fromkeys(members, w))
            stats["is_weight"] += w
            stats["is_clipped"] += clipped
            stats["is_masked"] += masked
            stats["is_units"] += 1
    else:
        for i, token in enumerate(tokens):
            w, clipped, masked = reference_weight(
                float(token["logp"].detach()) - token["q"], config
            )
            weights[i] = w
            stats["is_weight"] += w
            stats["is_clipped"] += clipped
            stats["is_masked"] += masked
            stats["is_units"] += 1
    losses = []
    for i, token in enumerate(tokens):
        members = by_sample[token["sample"]]
        mean_log_ratio = sum(tokens[j]["logp"] - tokens[j]["q"] for j in members) / len(members)
        _, high, low = formulas.reference_token_loss(token, config, mean_log_ratio)
        log_r = token["logp"] - token["q"]
        loss = config.kl_tau * log_r**2
        if not (high or low):
            own = mean_log_ratio if config.kind == "gspo" else log_r
            loss = loss - token["a"] * weights[i] * torch.exp(own - own.detach())
        losses.append(loss)
    aggregation = "sequence" if config.kind == "gspo" else config.aggregation
    if aggregation == "token":
        total = sum(losses)
    elif aggregation == "constant":
        total = sum(losses) / formulas.MAX_NEW_TOKENS
    else:
        total = sum(sum(losses[j] for j in m) / len(m) for m in by_sample.values())
    total.backward()
    return total.detach(), leaf.grad, stats


CORRECTIONS = [name for name in IS_CORRECTIONS if name != "none"]


@pytest.mark.parametrize("aggregation", formulas.AGGREGATIONS)
@pytest.mark.parametrize("level", list(IS_LEVELS))
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("kind", formulas.KINDS)
def test_each_kind_correction_and_level_matches_the_formulas(kind, correction, level, aggregation):
    # Ratios spread enough that tis clips and mis masks some units but not all; at the sequence
    # level the products spread far wider, so the bounds there are wider too.
    settings = {
        ("tis", "token"): {"is_cap": 1.5},
        ("tis", "sequence"): {"is_cap": 3.0},
        ("mis", "token"): {"is_bounds": (0.6, 1.6)},
        ("mis", "sequence"): {"is_bounds": (0.2, 5.0)},
    }[correction, level]
    config = dataclasses.replace(
        formulas.CONFIGS[kind],
        aggregation=aggregation,
        kl_tau=0.05,
        is_correction=correction,
        is_level=level,
        **settings,
    )
    logits, mb = formulas.random_case(1, with_inference=True, noise=0.5)
    loss, sums = formulas.loss_of(logits, mb, config)
    loss.backward()
    ref_loss, ref_grad, stats = reference(logits, mb, config)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    for key, value in stats.items():
        assert float(sums[key]) == pytest.approx(value, rel=1e-5, abs=1e-5), key
    counted = stats["is_clipped"] if correction == "tis" else stats["is_masked"]
    assert 0 < counted < stats["is_units"]  # the case exercises both sides of the bound


def test_a_correction_without_the_samplers_logprobs_is_a_clear_error():
    inputs = dataclasses.replace(inputs_with_ratios(*TOKENS), inference_logprobs=None)
    config = RLLossConfig(**NO_MASK, is_correction="tis")
    with pytest.raises(ValueError, match="needs the sampler's logprobs"):
        token_loss(inputs, config)


# The config ----------------------------------------------------------------------------------


def config_with(**loss) -> RLConfig:
    return RLConfig(loss=RLLossConfig(**loss), rollout=RolloutConfig(engine="external"))


def two_arguments(inputs, config):
    return inputs.logp


@pytest.mark.parametrize(
    "loss, message",
    [
        ({"is_cap": 0.5}, r"'loss.is_cap' = 0.5: must be a finite number >= 1"),
        ({"is_cap": float("inf")}, r"'loss.is_cap' = inf: must be a finite number >= 1"),
        ({"is_bounds": (1.2, 5.0)}, r"'loss.is_bounds' = \(1.2, 5.0\): must be \[low, high\]"),
        ({"is_bounds": (0.5, 0.9)}, r"'loss.is_bounds' = \(0.5, 0.9\)"),
        ({"is_bounds": (-0.1, 2.0)}, r"'loss.is_bounds'"),
        ({"is_bounds": (0.5, float("inf"))}, r"'loss.is_bounds'.*high finite"),
        (
            {"kind": "custom", "custom": f"{__name__}:two_arguments", "is_correction": "tis"},
            r"'loss.is_correction' = 'tis': applies to the built-in loss kinds",
        ),
    ],
)
def test_bad_correction_settings_name_the_key(loss, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_with(**loss), world_size=1)


def test_good_correction_settings_pass():
    for correction in IS_CORRECTIONS:
        for level in IS_LEVELS:
            validate(config_with(is_correction=correction, is_level=level), world_size=1)
    validate(config_with(is_correction="mis", is_bounds=(0.0, 1.0)), world_size=1)


# The step ------------------------------------------------------------------------------------


def corrected_state(tiny_model_dir, correction="tis", level="token"):
    loss = RLLossConfig(is_correction=correction, is_level=level, is_cap=1.2, is_bounds=(0.8, 1.25))
    return rl.make_state(tiny_model_dir, loss=loss)


def sampler_logprobs(model, rows) -> torch.Tensor:
    """The model's own logprobs moved by noise of scale 0.3: a sampler that disagrees."""
    noise = 0.3 * torch.randn(rows.input_ids.shape, generator=torch.Generator().manual_seed(1))
    return (rl.own_logprobs(model, rows) + noise).clamp_max(0.0)


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_a_steps_row_has_the_corrections_metrics(tiny_model_dir, correction):
    state = corrected_state(tiny_model_dir, correction)
    rows = rl.random_rows(0)
    _, metrics = rl_step(state, rl.rl_batch(rows, sampler_logprobs(state.handles.model, rows)))
    counted = "clipped" if correction == "tis" else "masked"
    other = "masked" if correction == "tis" else "clipped"
    assert f"loss/is_{counted}_fraction" in metrics and "loss/is_weight_mean" in metrics
    assert f"loss/is_{other}_fraction" not in metrics
    assert 0 < float(metrics[f"loss/is_{counted}_fraction"]) < 1
    assert 0 < float(metrics["loss/is_weight_mean"]) < 1.25


def test_without_a_correction_the_row_has_no_is_metrics(tiny_model_dir):
    state = rl.make_state(tiny_model_dir)
    rows = rl.random_rows(0)
    _, metrics = rl_step(state, rl.rl_batch(rows, rl.own_logprobs(state.handles.model, rows)))
    assert not any(key.startswith("loss/is_") for key in metrics)


def test_a_step_without_the_samplers_logprobs_stops_with_a_config_error(tiny_model_dir):
    state = corrected_state(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"'loss.is_correction' = 'tis'.*inference logprobs"):
        rl_step(state, rl.rl_batch(rl.random_rows(0), None))


@pytest.mark.parametrize("level", list(IS_LEVELS))
def test_a_corrected_rl_step_reads_nothing_back(tiny_model_dir, level):
    state = corrected_state(tiny_model_dir, "mis", level)
    rows = rl.random_rows(0)
    batch = rl.rl_batch(rows, rl.own_logprobs(state.handles.model, rows), size=1)
    assert step_reads(rl_step, state, batch) == {}


def test_the_metrics_divide_by_the_units():
    sums = {key: torch.tensor(0.0) for key in SUM_KEYS}
    sums.update(is_weight=torch.tensor(6.0), is_clipped=torch.tensor(1.0))
    sums.update(is_masked=torch.tensor(2.0), is_units=torch.tensor(4.0))
    totals = formulas.totals_of(sums, loss_tokens=10.0)
    tis = rl_metrics(totals, False, False, "tis")
    assert float(tis["loss/is_clipped_fraction"]) == pytest.approx(0.25)
    assert float(tis["loss/is_weight_mean"]) == pytest.approx(1.5)
    mis = rl_metrics(totals, False, False, "mis")
    assert float(mis["loss/is_masked_fraction"]) == pytest.approx(0.5)
    skipped = rl_metrics(formulas.totals_of({}, loss_tokens=10.0), False, False, "mis")
    assert math.isnan(float(skipped["loss/is_masked_fraction"]))


@pytest.mark.parametrize(
    ("typed", "key"),
    [
        ("vllm_importance_sampling_mode", "loss.is_correction"),
        ("vllm_importance_sampling_clip_max", "loss.is_cap"),
        ("rollout_is_threshold", "loss.is_cap"),
    ],
)
def test_trl_and_verl_names_are_answered_with_the_keys(typed, key):
    with pytest.raises(ConfigError, match=rf"unknown key '{typed}'.*did you mean '{key}'"):
        load_config([f"--{typed}=2"], RLConfig)


@pytest.mark.parametrize("level", list(IS_LEVELS))
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_micro_batches_of_one_row_give_the_full_batch_gradient(tiny_model_dir, correction, level):
    """The weights are per token or per sample, and a sample sits whole in one micro-batch, so
    accumulation changes neither the gradient nor the is_* sums."""
    config = RLLossConfig(
        kind="ratio",
        kl_tau=0.1,
        is_correction=correction,
        is_level=level,
        is_cap=1.2,
        is_bounds=(0.3, 3.0) if level == "sequence" else (0.8, 1.25),
    )
    state = rl.make_state(tiny_model_dir, loss=config)
    model, runtime = state.handles.model, state.handles.runtime
    rows = rl.random_rows(3)
    inference = sampler_logprobs(model, rows)

    def grads_for(micro_batch_size):
        model.zero_grad(set_to_none=True)
        batch = rl.rl_batch(rows, inference, micro_batch_size)
        totals = rl_gradients_(model, batch, runtime, config, chunk_tokens=16)
        return totals, [p.grad.clone() for p in model.parameters()]

    full_totals, full = grads_for(rl.ROWS)
    acc_totals, acc = grads_for(1)
    counted = full_totals.sums["is_clipped" if correction == "tis" else "is_masked"]
    assert 0 < float(counted) < float(full_totals.sums["is_units"])
    for key in ("is_weight", "is_clipped", "is_masked", "is_units"):
        torch.testing.assert_close(acc_totals.sums[key], full_totals.sums[key])
    torch.testing.assert_close(acc_totals.loss_sum, full_totals.loss_sum, rtol=0, atol=1e-4)
    for g_full, g_acc in zip(full, acc):
        torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)
