"""The engines table (fnt.config.engines): every entry's implementation imports and takes the
arguments the driver passes, the config's choices are the table's, and an engine added as one
file and one entry is validated, built and trained on like the built-in ones."""

from __future__ import annotations

import pytest
import torch

from fnt import fold, init_state, rl_source
from fnt.build import policy_publisher
from fnt.config import (
    ENGINES,
    ConfigError,
    Engine,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    field_types,
    validate,
)
from fnt.config.references import import_function
from fnt.distributed.runtime import setup_trainer
from steps import rl_step
from tests.fnt.rollout.toy_engine import ToyEngine


@pytest.mark.parametrize("name", list(ENGINES))
def test_each_entry_names_what_the_driver_calls(name):
    engine = ENGINES[name]
    import_function(engine.build, 2)  # cls(config, runtime)
    if engine.publish:
        import_function(engine.publish, 1)  # publish(state)
    assert engine.lora_publish in ("adapter", "merged")
    assert engine.summary


def test_the_config_offers_the_tables_engines():
    engine_type = field_types(RolloutConfig)["engine"]
    assert engine_type.__args__ == tuple(ENGINES)


def test_an_unknown_engine_is_named_with_the_engines_there_are():
    config = RLConfig(rollout=RolloutConfig(engine="vlm", prompts="p.jsonl", reward="similarity"))
    with pytest.raises(ConfigError, match=r"'rollout.engine' = 'vlm'.*did you mean 'vllm'"):
        validate(config, 1)


def test_the_publisher_is_the_engines():
    def config(engine):
        return RLConfig(rollout=RolloutConfig(engine=engine))

    assert policy_publisher(config("in_process")) is None
    assert policy_publisher(config("external")).__name__ == "publish_weights_"
    assert policy_publisher(config("vllm")).__name__ == "publish_to_vllm_"


def test_an_engine_added_as_one_file_and_one_entry_trains(monkeypatch, tiny_model_dir, tmp_path):
    toy = Engine(
        summary="the same four samples at every step",
        build="tests.fnt.rollout.toy_engine:ToyEngine",
        samples_prompts=False,
    )
    monkeypatch.setitem(ENGINES, "toy", toy)
    config = RLConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        output_dir=str(tmp_path),
        seq_len=32,
        batch_size=2,
        micro_batch_size=2,
        max_steps=2,
        rollout=RolloutConfig(engine="toy"),
    )
    validate(config, 1)
    state = init_state(config, setup_trainer(config))
    assert isinstance(state.handles.rollouts, ToyEngine)
    before = [p.detach().clone() for p in state.handles.model.parameters()]
    rows = []
    for state, metrics in fold(state, rl_source, rl_step, 2):
        rows.append(metrics)
    assert state.progress.step == 2
    assert float(rows[-1]["reward/mean"]) == 1.5
    after = list(state.handles.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    # The table decides: the same config with an engine name the table lacks is refused.
    monkeypatch.delitem(ENGINES, "toy")
    with pytest.raises(ConfigError, match="'rollout.engine' = 'toy'"):
        validate(config, 1)
