"""The loss-facts tables (fnt.config.losses) against the step functions: the config offers the
tables' names, every built-in kind has its function in steps/ (LOSS_KINDS, LOSSES) and a formula
test (the KINDS of test_rl_loss.py and test_dpo.py), and each fact an entry states holds of its
function: an RL kind's own settings change its loss and no other's, the zero-advantage skip, its
own aggregation; a preference loss's reference-freedom, label smoothing and per-token rewards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fnt.config import ConfigError, PreferenceConfig, RLLossConfig, field_types
from fnt.config.losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    IS_LEVELS,
    PREFERENCE_LOSSES,
    RL_LOSS_KEYS,
    RL_LOSSES,
    preference_loss,
    rl_loss,
)
from fnt.preference import PairLogps, needs_reference, pair_rewards
from steps.dpo_losses import LOSSES
from steps.rl_losses import (
    LOSS_KINDS,
    LossInputs,
    aggregate,
    aggregation_of,
    per_sample,
    token_loss,
    zero_without_advantages,
)
from tests.steps import test_dpo, test_rl_loss

BUILT_IN_RL = [name for name, kind in RL_LOSSES.items() if not kind.custom]
BUILT_IN_PREFERENCE = [name for name, loss in PREFERENCE_LOSSES.items() if not loss.custom]


def test_the_config_offers_the_tables_names():
    assert field_types(RLLossConfig)["kind"].__args__ == tuple(RL_LOSSES)
    assert field_types(RLLossConfig)["aggregation"].__args__ == tuple(AGGREGATIONS)
    assert field_types(PreferenceConfig)["loss"].__args__ == tuple(PREFERENCE_LOSSES)


def test_every_built_in_kind_has_its_function_and_its_formula_test():
    assert list(LOSS_KINDS) == BUILT_IN_RL
    assert list(LOSSES) == BUILT_IN_PREFERENCE
    assert set(test_rl_loss.KINDS) == set(test_rl_loss.CONFIGS) == set(BUILT_IN_RL)
    assert set(test_rl_loss.AGGREGATIONS) == set(AGGREGATIONS)
    assert set(test_dpo.KINDS) == set(BUILT_IN_PREFERENCE)
    for table in (RL_LOSSES, PREFERENCE_LOSSES):
        assert all(entry.summary for entry in table.values())


def test_a_name_outside_the_tables_is_named_with_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"'loss.kind' = 'gpso'.*did you mean 'gspo'"):
        rl_loss("gpso")
    with pytest.raises(ConfigError, match=r"'dpo.loss' = 'simp'.*did you mean 'simpo'"):
        preference_loss("simp")


def test_every_number_of_the_loss_section_is_one_kinds_one_corrections_or_shared():
    types = field_types(RLLossConfig)
    numbers = [key for key, tp in types.items() if tp is float]
    keys = [key for kind in RL_LOSSES.values() for key in kind.keys] + list(RL_LOSS_KEYS)
    keys += [key for entry in IS_CORRECTIONS.values() for key in entry.keys if key in numbers]
    assert sorted(keys) == sorted(numbers) and len(set(keys)) == len(keys)


def test_the_config_offers_the_corrections_and_each_ones_settings_are_its_own():
    types = field_types(RLLossConfig)
    assert types["is_correction"].__args__ == tuple(IS_CORRECTIONS)
    assert types["is_level"].__args__ == tuple(IS_LEVELS)
    own = [key for entry in IS_CORRECTIONS.values() for key in entry.keys]
    assert len(set(own)) == len(own) and all(key in types for key in own)
    # Each correction's settings change its weights, and no other correction's.
    inputs = loss_inputs(4)
    moved = {"is_cap": 1.01, "is_bounds": (0.9, 1.1)}
    for name, entry in IS_CORRECTIONS.items():
        for level in IS_LEVELS:
            config = RLLossConfig(kind="ratio", kl_tau=0.0, is_correction=name, is_level=level)
            base = token_loss(inputs, config).loss.detach()
            for key, value in moved.items():
                changed = token_loss(inputs, dataclasses.replace(config, **{key: value}))
                assert torch.equal(base, changed.loss.detach()) == (key not in entry.keys)
            assert (token_loss(inputs, config).correction is None) == (not entry.counts)


def loss_inputs(seed: int, advantages=None) -> LossInputs:
    """Ten loss tokens of three samples, with inference logprobs far enough from the policy's
    that every kind masks some tokens at thresholds of 0 and none at 10."""
    gen = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(10, generator=gen)).requires_grad_()
    inference = (logp.detach() + torch.randn(10, generator=gen)).clamp_max(-1e-3)
    if advantages is None:
        advantages = torch.tensor([1.0] * 4 + [-1.0] * 3 + [0.5] * 3)
    return LossInputs(
        logp=logp,
        inference_logprobs=inference,
        ref_logprobs=None,
        advantages=advantages,
        sample_ids=torch.tensor([0] * 4 + [1] * 3 + [2] * 3),
        num_samples=3,
    )


def loss_value(kind: str, **settings) -> torch.Tensor:
    config = RLLossConfig(kind=kind, kl_tau=0.0, **settings)
    return token_loss(loss_inputs(0), config).loss.detach()


@pytest.mark.parametrize("kind", BUILT_IN_RL)
def test_a_kinds_own_settings_change_its_loss_and_the_others_do_not(kind):
    for key in RL_LOSSES[kind].keys:
        assert not torch.equal(loss_value(kind, **{key: 0.0}), loss_value(kind, **{key: 10.0}))
    others = [key for name in BUILT_IN_RL if name != kind for key in RL_LOSSES[name].keys]
    for key in others:
        assert torch.equal(loss_value(kind, **{key: 0.0}), loss_value(kind, **{key: 10.0}))


@pytest.mark.parametrize("kind", BUILT_IN_RL)
def test_the_zero_advantage_skip_is_the_kinds_fact_and_holds(kind):
    config = RLLossConfig(kind=kind, kl_tau=0.0)
    assert zero_without_advantages(config, True) == RL_LOSSES[kind].zero_without_advantages
    if RL_LOSSES[kind].zero_without_advantages:
        inputs = loss_inputs(1, advantages=torch.zeros(10))
        token_loss(inputs, config).loss.sum().backward()
        assert torch.equal(inputs.logp.grad, torch.zeros(10))
    custom = [name for name, entry in RL_LOSSES.items() if entry.custom]
    assert not any(zero_without_advantages(RLLossConfig(kind=c), False) for c in custom)


@pytest.mark.parametrize("kind", list(RL_LOSSES))
def test_a_kinds_own_aggregation_is_the_one_it_uses(kind):
    own = RL_LOSSES[kind].aggregation
    for aggregation in AGGREGATIONS:
        config = RLLossConfig(kind=kind, aggregation=aggregation)
        assert aggregation_of(config) == (own or aggregation)
    if own and not RL_LOSSES[kind].custom:
        inputs = loss_inputs(2)
        terms = token_loss(inputs, RLLossConfig(kind=kind)).loss
        assert torch.equal(aggregate(terms, inputs, own), aggregate(terms, inputs, "sequence"))


def test_each_aggregation_is_handled_and_divides_by_what_its_entry_says():
    inputs = loss_inputs(3)
    ones = torch.ones(10)
    for name, entry in AGGREGATIONS.items():
        assert per_sample(name) == entry.per_sample
        total = aggregate(ones, inputs, name, max_new_tokens=5)
        # A loss of 1 on every token: "token" sums to N, "sequence" to S, "constant" to N / L.
        want = {"token": 10.0, "sequence": 3.0, "constant": 2.0}[name]
        assert float(total) == pytest.approx(want)
    assert not per_sample("no such aggregation")


def pairs(scale: float = 1.0, reference: bool = True) -> PairLogps:
    """Four pairs; `scale` multiplies every logprob and token count (the mean logprob per
    token stays)."""
    tokens = torch.tensor([[3.0, 5.0], [4.0, 2.0], [6.0, 6.0], [1.0, 7.0]], dtype=torch.float64)
    means = -torch.tensor([[0.5, 0.9], [1.2, 0.3], [0.7, 0.7], [0.2, 1.5]], dtype=torch.float64)
    ref_means = means + torch.tensor([0.1, -0.2, 0.05, 0.3], dtype=torch.float64)[:, None]
    logps, ref = scale * tokens * means, scale * tokens * ref_means
    return PairLogps(
        chosen=logps[:, 0],
        rejected=logps[:, 1],
        chosen_tokens=scale * tokens[:, 0],
        rejected_tokens=scale * tokens[:, 1],
        ref_chosen=ref[:, 0] if reference else None,
        ref_rejected=ref[:, 1] if reference else None,
    )


@pytest.mark.parametrize("name", BUILT_IN_PREFERENCE)
def test_a_preference_losss_facts_hold_of_its_function(name):
    entry, loss = PREFERENCE_LOSSES[name], LOSSES[name]
    config = PreferenceConfig(loss=name, beta=0.3, label_smoothing=0.2, simpo_gamma=0.4)
    # Reference-free: it runs on pairs without reference logprobs; otherwise it needs them.
    assert needs_reference(config) == (not entry.reference_free)
    if entry.reference_free:
        assert torch.equal(loss(pairs(reference=False), config), loss(pairs(), config))
    else:
        with pytest.raises(ValueError, match="needs reference logprobs"):
            loss(pairs(reference=False), config)
    # Label smoothing changes the loss exactly when the loss takes it.
    plain = dataclasses.replace(config, label_smoothing=0.0)
    assert (not torch.equal(loss(pairs(), config), loss(pairs(), plain))) == entry.label_smoothing
    # Per-token: the loss and the rewards stay when every logprob and count doubles.
    for values in (lambda p: loss(p, plain), lambda p: torch.stack(pair_rewards(p, plain))):
        same = torch.allclose(values(pairs(2.0)), values(pairs()), rtol=1e-12, atol=1e-12)
        assert same == entry.per_token_rewards, name
