"""Fixtures of the rollout tests: RL configs and states; the policy that sometimes stops and the
prompts file are session fixtures of tests/conftest.py (two-rank jobs use them too)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt import init_state
from fnt.config import ModelConfig, RLConfig, RolloutConfig, RuntimeConfig
from fnt.distributed.runtime import setup_trainer


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def eval_model(policy_dir):
    return AutoModelForCausalLM.from_pretrained(policy_dir).eval()


def rl_config(model_dir, prompts, **rollout) -> RLConfig:
    """8 rows of 128 tokens per step, 4 prompts x 4 completions of at most 10 tokens.

    One thread: decoding the tiny model is latency-bound, and a second thread only adds waiting
    on a busy machine.
    """
    settings = dict(
        prompts=str(prompts),
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=10,
        temperature=1.0,
        reward="similarity",
        # The engines' own tests save no samples (they would land in runs/default); the runs of
        # tests/e2e and the two-rank test turn them on.
        log_samples_every=-1,
    )
    return RLConfig(
        model=ModelConfig(name=str(model_dir)),
        seed=3,
        seq_len=128,
        batch_size=8,
        micro_batch_size=2,
        runtime=RuntimeConfig(num_threads=1),
        rollout=RolloutConfig(**{**settings, **rollout}),
    )


def one_process_runtime():
    """The Runtime of a plain one-process CPU run, without setup_trainer's side effects."""
    from fnt.config import ParallelConfig
    from fnt.config.parallel import plan_parallel_dims
    from fnt.distributed.runtime import Runtime
    from fnt.optim.setup import NO_OFFLOAD

    return Runtime(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        device=torch.device("cpu"),
        distributed=False,
        dims=plan_parallel_dims(ParallelConfig(), 1, 1),
        mesh=None,
        num_threads=torch.get_num_threads(),
        offload=NO_OFFLOAD,
    )


def rl_state(config: RLConfig):
    return init_state(config, setup_trainer(config))


def scale_weights_(model, factor: float) -> None:
    """Scale every weight in place: a deterministic stand-in for an update of the live policy."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
