"""fnt.testing: its strategies draw what they promise, and its two properties hold for sft_step
and rl_step and catch a step that breaks them (one whose randomness a resume cannot restore,
one that writes a row of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.config import (
    CkptConfig,
    Config,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    RuntimeConfig,
    validate,
)
from fnt.faults import parse_fault
from fnt.sources import rl_source, sft_source
from fnt.store.rundir import METRICS_FILE
from fnt.testing import (
    PROPERTY_SETTINGS,
    assert_one_row_per_step,
    assert_resume_exact,
    crash_points,
    metric_dicts,
    tiny_configs,
)
from steps import rl_step, sft_step

SETTINGS = settings(max_examples=40, deadline=None)


def sft_step_with_unseeded_noise(state, batch):
    """A broken step: its noise comes from torch's global generator, which a resumed process
    starts afresh (fnt's own randomness is a function of seed and step)."""
    state, metrics = sft_step(state, batch)
    with torch.no_grad():
        for p in state.handles.model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    return state, metrics


def sft_step_that_writes_its_own_row(state, batch):
    """A broken step: it logs its step a second time, into metrics.jsonl itself."""
    state, metrics = sft_step(state, batch)
    row = {"step": state.progress.step, "loss/mean": float(metrics["loss/mean"])}
    with open(Path(state.config.output_dir) / METRICS_FILE, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return state, metrics


def short_run(config_cls, model_dir, **fields):
    """4 steps of the tiny model with a checkpoint after each (the properties set output_dir)."""
    return config_cls(
        model=ModelConfig(name=str(model_dir)),
        max_steps=4,
        batch_size=4,
        micro_batch_size=2,
        ckpt=CkptConfig(interval=1, keep_last=2),
        runtime=RuntimeConfig(num_threads=1),
        **fields,
    )


@pytest.fixture(scope="module")
def sft_config(tiny_model_dir):
    return short_run(Config, tiny_model_dir, seq_len=32)


@SETTINGS
@given(data=st.data(), ranks=st.sampled_from((1, 2)), kind=st.sampled_from(("sft", "rl")))
def test_drawn_configs_are_valid_for_the_drawn_ranks(
    tiny_model_dir, prompts_file, data, ranks, kind
):
    config = data.draw(
        tiny_configs(tiny_model_dir, "runs/x", kind=kind, ranks=ranks, prompts=prompts_file)
    )
    validate(config, ranks)
    assert config.ckpt.interval >= 1 and config.max_steps <= 6


@SETTINGS
@given(crash_points(5, ranks=2))
def test_crash_points_are_fault_specs(fault):
    assert parse_fault(f"{fault.phase}@{fault.step}:{fault.rank}") == fault
    assert 1 <= fault.step <= 5 and fault.phase != "wandb"


@SETTINGS
@given(metric_dicts(finite=False))
def test_metric_dicts_are_floats_by_name(metrics):
    assert all(isinstance(v, float) for v in metrics.values()) and "step" not in metrics


@PROPERTY_SETTINGS
@given(kill=crash_points(4))
def test_sft_step_resumes_exactly_wherever_it_is_killed(sft_config, tmp_path_factory, kill):
    work = tmp_path_factory.getbasetemp() / "sft_resume"
    assert_resume_exact(sft_config, sft_step, sft_source, kill, workdir=work)


def test_a_step_whose_randomness_is_not_restored_fails_resume_exactness(sft_config, tmp_path):
    with pytest.raises(AssertionError, match="killed at row@2 and resumed"):
        assert_resume_exact(
            sft_config, sft_step_with_unseeded_noise, sft_source, "row@2", workdir=tmp_path
        )


@pytest.mark.slow  # the default suite's time; the next test runs the same property on a kill
@PROPERTY_SETTINGS
@given(kills=st.lists(crash_points(4), max_size=1))
def test_sft_step_writes_each_row_once_whatever_the_kills(sft_config, tmp_path_factory, kills):
    work = tmp_path_factory.mktemp("one_row")
    assert_one_row_per_step(sft_config, sft_step, sft_source, kills, workdir=work)


def test_a_step_that_logs_twice_fails_one_row_per_step(sft_config, tmp_path):
    with pytest.raises(AssertionError, match="not each of 1..4 once"):
        assert_one_row_per_step(
            sft_config, sft_step_that_writes_its_own_row, sft_source, ["row@2"], workdir=tmp_path
        )


@pytest.mark.slow
def test_rl_step_resumes_exactly_and_writes_each_row_once(tiny_model_dir, prompts_file, tmp_path):
    rollout = RolloutConfig(
        prompts=str(prompts_file), reward="ascii_letters", prompts_per_step=2, max_new_tokens=8
    )
    config = short_run(RLConfig, tiny_model_dir, seq_len=128, rollout=rollout)
    assert_resume_exact(config, rl_step, rl_source, "step@3", workdir=tmp_path / "resume")
    assert_one_row_per_step(
        config, rl_step, rl_source, ["row@2", "shards@3"], workdir=tmp_path / "rows"
    )
