"""Fixtures of the rollout tests: a tiny model that sometimes stops, a prompts file, RL configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt import init_state
from fnt.config import ModelConfig, RLConfig, RolloutConfig, RuntimeConfig
from fnt.setup import setup_trainer

# Reversal puzzles of 2-6 letters: short prompts, and an "answer" for the similarity reward.
WORDS = ["ab", "cat", "dove", "eagle", "falcon", "go", "hen", "ibis", "jays", "kiwi", "lark"]


@pytest.fixture(scope="session")
def policy_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its eos row of lm_head scaled 20x.

    The random tiny model almost never samples eos; scaled, eos becomes likely in some contexts
    and unlikely in others, so completions end at different lengths and some hit max_new_tokens.
    """
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 20.0
    out = tmp_path_factory.mktemp("policy") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def eval_model(policy_dir):
    return AutoModelForCausalLM.from_pretrained(policy_dir).eval()


def write_prompts(path: Path) -> Path:
    lines = [
        json.dumps({"prompt": word[::-1], "answer": word, "id": i}) for i, word in enumerate(WORDS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


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
    from fnt.optim.setup import NO_OFFLOAD
    from fnt.parallel import plan_parallel_dims
    from fnt.setup import Runtime

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
