"""init_state, restore_, the SFT source and the resume decision of the driver, on the tiny model."""

from __future__ import annotations

import pytest
import torch

from fnt import Config, ConfigError, ModelConfig, fold, init_state, restore_, sft_source
from fnt.build import save_state_
from fnt.distributed.runtime import setup_trainer
from fnt.start import start_state
from fnt.state import StaleStateError
from fnt.store.rundir import ckpt_root, step_dir
from steps import sft_step


def config_for(model_dir, out, **overrides) -> Config:
    return Config(
        model=ModelConfig(name=str(model_dir)),
        output_dir=str(out),
        seq_len=32,
        batch_size=4,
        micro_batch_size=2,
        **overrides,
    )


def train(state, steps: int):
    for state, _ in fold(state, sft_source, sft_step, steps):
        pass
    return state


def test_init_state_ignores_checkpoints_and_restore_loads_one(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path)
    trained = train(init_state(config, setup_trainer(config)), 2)
    save_state_(trained)

    fresh = init_state(config, setup_trainer(config))  # an earlier run's checkpoint: no refusal
    assert fresh.progress.step == 0
    restored = restore_(fresh, step_dir(ckpt_root(config.output_dir), 2))
    assert restored.progress == trained.progress
    for (name, a), b in zip(
        trained.handles.model.named_parameters(), restored.handles.model.parameters()
    ):
        assert torch.equal(a, b), name
    with pytest.raises(StaleStateError):
        sft_step(fresh, sft_source(restored))  # the state restore_ consumed
    # Restored training continues exactly as the original does.
    assert train(restored, 1).progress == train(trained, 1).progress


def test_the_driver_refuses_a_fresh_start_over_earlier_checkpoints(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path)
    save_state_(train(init_state(config, setup_trainer(config)), 1))
    with pytest.raises(ConfigError, match="already holds checkpoints.*--resume latest"):
        start_state(config, setup_trainer(config))
    resumed = config_for(tiny_model_dir, tmp_path, resume="latest")
    assert start_state(resumed, setup_trainer(resumed)).progress.step == 1


def test_the_sft_source_reads_only_the_state_it_is_given(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path)
    state = init_state(config, setup_trainer(config))
    batch = sft_source(state)
    again = sft_source(state)
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(batch.micro_batches, again.micro_batches)
    )
    stepped, _ = sft_step(state, batch)
    with pytest.raises(StaleStateError):
        sft_source(state)
    assert not torch.equal(
        sft_source(stepped).micro_batches[0].input_ids, batch.micro_batches[0].input_ids
    )


def test_the_public_api_is_documented():
    import fnt

    for name in fnt.__all__:
        doc = getattr(fnt, name).__doc__
        # dataclasses make up a signature as the docstring of a class that has none
        assert doc and doc.strip() and not doc.startswith(name + "("), f"fnt.{name}: no docstring"
    from fnt.optim import CPUAdamW  # noqa: F401  (the path the native optimizer is known by)
