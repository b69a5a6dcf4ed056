"""fnt.model.lora on the tiny models: adapters on a frozen base, their start, the base inside the
adapted model, merging, the base's fingerprint, and the config rules."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.config import Config, ConfigError, LoraConfig, ModelConfig, RLConfig, validate
from fnt.config.schema import RolloutConfig
from fnt.model.lora import (
    adapter_init,
    adapters_disabled,
    add_adapters_,
    base_fingerprint,
    base_name,
    init_adapters_,
    merge_adapters,
)

LORA = LoraConfig(rank=4, alpha=8.0)
PROBE = torch.arange(3, 43).reshape(2, 20)


def adapted(model_dir, lora=LORA, seed=0):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_adapters_(model, lora)
    init_adapters_(model, seed)
    return model.eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def trained_like_(model, seed=1):
    """Give every lora_B random values, as training would, so the adapters change the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def test_only_the_adapters_train_and_they_start_as_the_base(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = adapted(tiny_model_dir)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear of every layer got one ("all-linear"), the LM head did not
    assert len(trainable) == 2 * 7 * base.config.num_hidden_layers
    assert not any("lm_head" in n for n in trainable)
    # B starts at zero, so the adapted model computes exactly the base
    assert torch.equal(logits(model), logits(base))


def test_the_start_is_a_function_of_seed_and_name():
    a = adapter_init("model.layers.0.q_proj.lora_A.default.weight", (4, 64), seed=3)
    assert torch.equal(a, adapter_init("model.layers.0.q_proj.lora_A.default.weight", (4, 64), 3))
    assert not torch.equal(
        a, adapter_init("model.layers.0.q_proj.lora_A.default.weight", (4, 64), 4)
    )
    assert not torch.equal(
        a, adapter_init("model.layers.0.k_proj.lora_A.default.weight", (4, 64), 3)
    )
    assert a.abs().max() <= 1 / 8 and a.std() > 0.03  # uniform in +-1/sqrt(fan_in)
    assert not adapter_init("x.lora_B.default.weight", (64, 4), 3).any()


def test_base_names_are_the_names_in_the_base_files():
    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_name("lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert base_name("lm_head.original_module.weight") == "lm_head.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_with_adapters_disabled_the_model_is_its_base(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model = adapted(tiny_model_dir, LoraConfig(rank=4, modules_to_save=("lm_head",)))
    trained_like_(model)
    with torch.no_grad():
        model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    adapted_logits = logits(model)
    assert not torch.equal(adapted_logits, logits(base))
    grads_before = {n: p.requires_grad for n, p in model.named_parameters()}
    with adapters_disabled(model):
        assert torch.equal(logits(model), logits(base))
        assert model.lm_head.weight is model.lm_head.original_module.weight
    assert torch.equal(logits(model), adapted_logits)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads_before


def test_merging_gives_the_adapted_model_and_peft_s_own_merge(tiny_model_dir, tmp_path):
    from peft import PeftModel

    model = adapted(tiny_model_dir)
    trained_like_(model)
    want = logits(model)

    # The model's own state dict, its live parameters: merging must not change the model.
    merged = merge_adapters(model.state_dict(), LORA)
    assert torch.equal(logits(model), want)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits(plain.eval()), want, rtol=0, atol=1e-5)

    from fnt.model.lora import save_adapter_

    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    save_adapter_(tmp_path / "adapter", model, trained, str(tiny_model_dir))
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter"
    ).eval()
    assert torch.equal(logits(peft_model), want)
    peft_merged = peft_model.merge_and_unload()
    for name, value in peft_merged.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6)


def test_the_fingerprint_follows_the_config_and_the_weights_index(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert base_fingerprint(copy) == base_fingerprint(tiny_model_dir)  # not the path

    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert base_fingerprint(copy) != base_fingerprint(tiny_model_dir)

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    model = AutoModelForCausalLM.from_pretrained(other)
    model.model.norm.weight.data = model.model.norm.weight.data.to(torch.bfloat16)
    model.save_pretrained(other)
    assert base_fingerprint(other) != base_fingerprint(tiny_model_dir)


def test_unknown_modules_are_config_errors_naming_the_key(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        add_adapters_(model, LoraConfig(rank=4, target_modules=("qq_proj",)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="model.lora.modules_to_save.*'score'"):
        add_adapters_(model, LoraConfig(rank=4, modules_to_save=("score",)))


@pytest.mark.parametrize(
    "lora, message",
    [
        (LoraConfig(rank=-1), "model.lora.rank"),
        (LoraConfig(rank=4, alpha=0.0), "model.lora.alpha"),
        (LoraConfig(rank=4, dropout=1.0), "model.lora.dropout"),
        (LoraConfig(rank=4, target_modules=()), "model.lora.target_modules"),
        (LoraConfig(rank=4, target_modules=("all-linear", "q_proj")), "preset"),
        (LoraConfig(rank=4, target_modules=("q_proj", "lm_head")), "modules_to_save"),
        (LoraConfig(rank=0, modules_to_save=("lm_head",)), "model.lora.modules_to_save"),
    ],
)
def test_bad_lora_settings_are_refused(lora, message):
    with pytest.raises(ConfigError, match=message):
        validate(Config(model=ModelConfig(name="m", lora=lora)), world_size=1)


def test_publishing_an_adapter_needs_lora():
    config = RLConfig(
        model=ModelConfig(name="m"),
        rollout=RolloutConfig(engine="external", publish="adapter"),
    )
    with pytest.raises(ConfigError, match="rollout.publish"):
        validate(config, world_size=1)
    validate(
        RLConfig(
            model=ModelConfig(name="m", lora=LoraConfig(rank=4)),
            rollout=RolloutConfig(engine="external", publish="adapter"),
        ),
        world_size=1,
    )


def test_the_in_process_engine_generates_with_the_adapters(tiny_model_dir, prompts_file):
    from fnt import init_state, setup_trainer

    config = RLConfig(
        model=ModelConfig(name=str(tiny_model_dir), lora=LORA),
        rollout=RolloutConfig(prompts=str(prompts_file), reward="ascii_letters"),
        batch_size=4,
        micro_batch_size=2,
        seq_len=128,
    )
    state = init_state(config, setup_trainer(config))
    policy, engine = state.handles.model, state.handles.rollouts
    trained_like_(policy)
    engine.sync_weights_(policy)
    copy_logits = logits(engine.model)
    assert torch.equal(copy_logits, logits(policy.eval()))
    assert not torch.equal(
        copy_logits, logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    )


def test_a_frozen_base_costs_4_flops_per_parameter_and_a_trained_one_6():
    from fnt.obs.metrics import flops_per_token

    full = flops_per_token(1000, num_layers=2, hidden_size=8, seq_len=16)
    assert full == 6 * 1000 + 6 * 2 * 8 * 16
    lora = flops_per_token(1000, num_layers=2, hidden_size=8, seq_len=16, frozen_params=900)
    assert lora == 6 * 100 + 4 * 900 + 6 * 2 * 8 * 16
