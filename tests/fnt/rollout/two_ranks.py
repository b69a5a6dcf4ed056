"""Run by test_two_ranks under torchrun: two rollouts of rl_source with an FSDP2-sharded policy
that changes in between. Side effect: writes each rank's batches to OUT/rank{rank}.pt.

usage: torchrun --nproc-per-node 2 two_ranks.py MODEL_DIR PROMPTS OUT
"""

from __future__ import annotations

import sys

import torch

from fnt import rl_source
from fnt.setup import teardown_trainer
from tests.fnt.rollout.conftest import rl_config, rl_state, scale_weights_


def two_batches(model_dir: str, prompts: str) -> tuple:
    """The first two batches of rl_source; the policy's weights are scaled by 1.05 in between
    (standing in for an update: the state advances without training)."""
    state = rl_state(rl_config(model_dir, prompts))
    first = rl_source(state)
    state = state.advance(data=first.data_after)
    scale_weights_(state.handles.model, 1.05)
    second = rl_source(state)
    return state.handles.runtime, (first, second)


if __name__ == "__main__":
    model_dir, prompts, out = sys.argv[1:4]
    runtime, batches = two_batches(model_dir, prompts)
    torch.save(batches, f"{out}/rank{runtime.rank}.pt")
    teardown_trainer(runtime)
