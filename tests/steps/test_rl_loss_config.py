"""The loss settings are checked when the config is validated, before any model is built:
loss.custom is imported and its shape checked, and contradicting keys are named."""

from __future__ import annotations

import dataclasses

import pytest

from fnt.config import ConfigError, RLConfig, RLLossConfig, RolloutConfig, validate

NOT_CALLABLE = 3


def two_arguments(inputs, config):
    return inputs.logp


def one_argument(inputs):
    return inputs.logp


def config_with(rollout=None, **loss) -> RLConfig:
    return RLConfig(loss=RLLossConfig(**loss), rollout=rollout or RolloutConfig(engine="external"))


def test_the_defaults_are_prime_rls():
    loss = RLLossConfig()
    assert (loss.kind, loss.dppo_mask_low, loss.dppo_mask_high, loss.kl_tau) == (
        "dppo_tv",
        0.2,
        0.2,
        1e-3,
    )
    assert loss.aggregation == "token" and loss.ref_kl_tau == 0.0
    validate(config_with(), world_size=1)


def test_a_custom_loss_that_can_run_passes():
    validate(config_with(kind="custom", custom=f"{__name__}:two_arguments"), world_size=1)


@pytest.mark.parametrize(
    "loss, message",
    [
        ({"kind": "custom"}, r"'loss.custom' = '': loss.kind = \"custom\" needs"),
        (
            {"kind": "custom", "custom": "no_such_module_xyz:fn"},
            r"'loss.custom' = 'no_such_module_xyz:fn': .*cannot import module 'no_such_module_xyz'",
        ),
        ({"kind": "custom", "custom": f"{__name__}:missing"}, "has no attribute 'missing'"),
        ({"kind": "custom", "custom": f"{__name__}:NOT_CALLABLE"}, "is not callable"),
        ({"kind": "custom", "custom": f"{__name__}:one_argument"}, "cannot take 2 positional"),
        ({"kind": "custom", "custom": "no_colon"}, "is not of the form 'module:function'"),
        ({"custom": f"{__name__}:two_arguments"}, r"'loss.custom' .* is set but loss.kind"),
        ({"kl_tau": -1.0}, "'loss.kl_tau' = -1.0: must be a finite number >= 0"),
        ({"ref_kl_tau": float("nan")}, "'loss.ref_kl_tau' = nan: must be a finite number"),
        ({"dppo_mask_high": -0.1}, "'loss.dppo_mask_high'"),
        ({"gspo_eps_low": -1e-4}, "'loss.gspo_eps_low'"),
    ],
)
def test_bad_loss_settings_name_the_key(loss, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_with(**loss), world_size=1)


def test_reference_logprobs_from_rollouts_need_the_external_engine(tmp_path):
    in_process = RolloutConfig(prompts=str(tmp_path / "p.jsonl"), reward="ascii_letters")
    with pytest.raises(ConfigError, match="'loss.ref_source' = 'rollouts': only the external"):
        validate(config_with(in_process, ref_source="rollouts", ref_kl_tau=0.1), world_size=1)
    validate(config_with(ref_source="rollouts", ref_kl_tau=0.1), world_size=1)
    validate(dataclasses.replace(config_with(in_process), loss=RLLossConfig()), world_size=1)
