"""The modes table (fnt.config.modes): every entry names what the builder, evaluation, preflight
and the `fnt` command call, with the arguments they pass; the `fnt` command runs each mode with
its entry's config class, step and source; the core chooses no mode by the config's class; and a
mode added as one entry (tests/fnt/toy_mode.py) is validated, checked, built and trained on like
the built-in ones."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fnt import fold, init_state
from fnt.apps.preflight import check_inputs, reference_models
from fnt.config import (
    MODES,
    Config,
    ConfigError,
    DPOConfig,
    ModelConfig,
    PreferenceConfig,
    RLConfig,
    RLLossConfig,
    RolloutConfig,
    all_keys,
    field_types,
    mode_of,
    validate,
)
from fnt.config.modes import has_val_data, held_out_prompts, reference_dir
from fnt.config.references import import_function
from fnt.distributed.runtime import setup_trainer
from tests.fnt import toy_mode
from tests.fnt.toy_mode import TOY, ToyConfig

ROOT = Path(__file__).resolve().parents[2]
REFERENCES = ("", "model", "precomputed", "rollouts")


@pytest.mark.parametrize("name", list(MODES))
def test_each_entry_names_what_its_callers_call(name):
    mode = MODES[name]
    import_function(mode.step, 2)  # step(state, batch)
    import_function(mode.source, 1)  # source(state)
    import_function(mode.handles, 3)  # handles(config, runtime, announce)
    import_function(mode.eval_data, 1)  # eval_data(config)
    import_function(mode.preflight, 1)  # preflight(config)
    assert mode.summary
    config = mode.config()
    assert mode_of(config) is mode
    assert mode.reference(config) in REFERENCES
    if mode.reference_key:
        assert mode.reference_key in all_keys(mode.config)
    # Its batches are rollouts exactly when its config has the rollout and loss sections.
    assert mode.rollouts == ("rollout" in field_types(mode.config))
    assert mode.rollouts == ("loss" in field_types(mode.config))


def test_a_config_is_of_the_mode_of_the_first_class_of_its_mro_with_an_entry():
    @dataclasses.dataclass(frozen=True)
    class MyRL(RLConfig):
        note: str = ""

    assert mode_of(MyRL()) is MODES["rl"]
    assert mode_of(DPOConfig()) is MODES["dpo"]
    assert mode_of(Config()) is MODES["sft"]
    with pytest.raises(TypeError, match="object is no mode's config"):
        mode_of(object())


@pytest.mark.parametrize("name", list(MODES))
def test_the_fnt_command_runs_the_entrys_config_class_step_and_source(name, monkeypatch):
    import fnt.__main__ as command
    import fnt.loop

    mode, seen = MODES[name], {}
    monkeypatch.setattr(
        command, "train", lambda argv, cls, train_config: seen.update(cls=cls, go=train_config)
    )
    command.COMMANDS[name](["--config", "x.toml"])
    assert seen["cls"] is mode.config
    monkeypatch.setattr(
        fnt.loop, "run", lambda config, step, source, **_: seen.update(step=step, source=source)
    )
    seen["go"](mode.config())
    assert seen["step"] is import_function(mode.step, 2)
    assert seen["source"] is import_function(mode.source, 1)


def test_where_the_reference_comes_from():
    rl = MODES["rl"].reference
    assert rl(RLConfig()) == ""
    assert rl(RLConfig(loss=RLLossConfig(ref_kl_tau=0.1))) == "model"
    assert rl(RLConfig(loss=RLLossConfig(ref_kl_tau=0.1, ref_source="rollouts"))) == "rollouts"
    dpo = MODES["dpo"].reference
    assert dpo(DPOConfig()) == "model"
    assert dpo(DPOConfig(dpo=PreferenceConfig(precompute_reference=True))) == "precomputed"
    for loss in ("simpo", "orpo"):
        assert dpo(DPOConfig(dpo=PreferenceConfig(loss=loss))) == ""
    assert MODES["sft"].reference(Config()) == ""
    named = RLConfig(loss=RLLossConfig(ref_model="ref/dir"))
    assert reference_dir(named) == "ref/dir"
    assert reference_models(named) == [("loss.ref_model", "ref/dir")]
    dpo_named = DPOConfig(dpo=PreferenceConfig(ref_model="d"))
    assert reference_models(dpo_named) == [("dpo.ref_model", "d")]
    assert reference_models(Config()) == [] and reference_dir(RLConfig()) == ""


def test_held_out_data_by_mode():
    tasks = RolloutConfig(environment="reasoning_gym:leg_counting")
    rl = RLConfig(rollout=tasks)
    assert held_out_prompts(rl) == 0 and not has_val_data(rl)
    held_out = dataclasses.replace(
        rl,
        rollout=dataclasses.replace(
            tasks, reasoning_gym=dataclasses.replace(tasks.reasoning_gym, val_size=3)
        ),
    )
    assert held_out_prompts(held_out) == 3 and has_val_data(held_out)
    assert not has_val_data(Config())


# A mode chosen by the config's class outside the table: isinstance/issubclass with a config
# class, or a look for a section the class may lack.
MODE_CHECK = re.compile(
    r"isinstance\([^()]*,\s*\(?\s*(Config|RLConfig|DPOConfig)\b"
    r"|getattr\([^()]*config[^()]*,\s*\"(rollout|loss|dpo)\""
    r"|hasattr\([^()]*config[^()]*,\s*\"(rollout|loss|dpo)\""
)


def test_the_library_chooses_no_mode_outside_the_table():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "fnt").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MODE_CHECK.search(line)
    ]
    assert found == []


def test_a_mode_added_as_one_entry_is_validated_checked_built_and_trained(
    monkeypatch, tiny_model_dir, tmp_path
):
    monkeypatch.setitem(MODES, "toy", TOY)
    monkeypatch.setattr(toy_mode, "PREFLIGHTS", [])
    config = ToyConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        output_dir=str(tmp_path / "run"),
        seq_len=16,
        batch_size=2,
        micro_batch_size=2,
        max_steps=2,
        shift=3,
    )
    assert mode_of(config) is TOY
    with pytest.raises(ConfigError, match="'shift' = 0: must be at least 1"):
        validate(dataclasses.replace(config, shift=0), 1)
    validate(config, 1)
    check_inputs(config, "the test")
    assert toy_mode.PREFLIGHTS == [3]
    state = init_state(config, setup_trainer(config))
    assert state.handles.data.seed == config.seed + 3
    step, source = import_function(TOY.step, 2), import_function(TOY.source, 1)
    rows = []
    for state, metrics in fold(state, source, step, 2):
        rows.append(metrics)
    assert state.progress.step == 2 and len(rows) == 2
    # The table decides: without its entry the class is a Config's, and its check is gone.
    monkeypatch.delitem(MODES, "toy")
    assert mode_of(config) is MODES["sft"]
    validate(dataclasses.replace(config, shift=0), 1)
