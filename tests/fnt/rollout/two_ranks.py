"""Two rollouts of rl_source with an FSDP2-sharded policy that changes in between: a two-rank job
of test_two_ranks (`save_two_batches`, tests/two_ranks.py), whose side effect is each rank's
batches in OUT/rank{rank}.pt; `two_batches` is also the one-process reference."""

from __future__ import annotations

import dataclasses

import torch

from fnt import rl_source
from fnt.distributed.runtime import teardown_trainer
from tests.fnt.rollout.conftest import rl_config, rl_state, scale_weights_


def two_batches(model_dir: str, prompts: str, output_dir: str) -> tuple:
    """The first two batches of rl_source; the policy's weights are scaled by 1.05 in between
    (standing in for an update: the state advances without training). Both steps' samples are
    saved in `output_dir`/samples."""
    config = rl_config(model_dir, prompts, log_samples_every=1)
    state = rl_state(dataclasses.replace(config, output_dir=output_dir))
    first = rl_source(state)
    state = state.advance(data=first.data_after)
    scale_weights_(state.handles.model, 1.05)
    second = rl_source(state)
    return state.handles.runtime, (first, second)


def save_two_batches(model_dir: str, prompts: str, out: str) -> None:
    runtime, batches = two_batches(model_dir, prompts, f"{out}/run")
    torch.save(batches, f"{out}/rank{runtime.rank}.pt")
    teardown_trainer(runtime)
