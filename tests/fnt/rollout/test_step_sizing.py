"""A step's episodes that outgrow the rows batch_size gives a rank run more micro-batches: the
step trains exactly as a configuration with enough rows (fnt.rollout.pack: Capacity)."""

from __future__ import annotations

import dataclasses

import torch

from fnt import fold
from fnt.sources import rl_source
from steps import rl_step

from .conftest import rl_config, rl_state

TOOLS = "tests.fnt.rollout.multi_turn_env:tools"
CLOCKED = ("rollout/tokens_per_second", "perf/throughput", "perf/throughput_per_rank", "perf/mfu")


def run_steps(config, steps: int):
    """The metrics rows, the largest step's sample tokens and the final weights of `steps`
    updates."""
    state = rl_state(config)
    sample_tokens, rows = [], []

    def measuring_source(state):
        batch = rl_source(state)
        sample_tokens.append(sum(sum(map(sum, mb.sample_lengths)) for mb in batch.micro_batches))
        return batch

    for state, metrics in fold(state, measuring_source, rl_step, steps):
        rows.append(
            {k: float(v) for k, v in metrics.items() if k not in CLOCKED and k[:5] != "time/"}
        )
    weights = {k: v.detach().clone() for k, v in state.handles.model.state_dict().items()}
    return rows, max(sample_tokens), weights


def test_episodes_past_the_configured_rows_train_as_with_enough_rows(policy_dir, prompts_file):
    # 4 prompts x 4 tool episodes of up to 3 turns: far more tokens than 2 rows of 128.
    few = rl_config(policy_dir, prompts_file, environment=TOOLS, max_turns=3, max_new_tokens=12)
    few = dataclasses.replace(few, batch_size=2, micro_batch_size=1, seed=0)
    enough = dataclasses.replace(few, batch_size=64)
    few_rows, tokens, few_weights = run_steps(few, 2)
    assert tokens > few.batch_size * few.seq_len  # the step outgrew its rows: once an error
    enough_rows, _, enough_weights = run_steps(enough, 2)
    assert few_rows == enough_rows
    assert any(row["reward/std"] > 0 for row in few_rows)  # the steps had something to learn
    for name, weight in enough_weights.items():
        assert torch.equal(few_weights[name], weight), name
