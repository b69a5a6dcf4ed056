"""RL steps on 2 ranks (FSDP2) for tests/steps/test_rl_ref_kl.py, a two-rank job
(tests/two_ranks.py).

Part 1, the zero-advantage skip: at step 1 only rank 0's advantages are all 0 (both ranks must
update), at step 2 every rank's are (both must skip). Part 2: one step with the reference KL on,
each rank on its half of the test batch. Each rank writes what the test checks to
OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from fnt import init_state
from fnt.config import ModelConfig, OptimConfig, RLConfig, RLLossConfig
from fnt.distributed.runtime import setup_trainer, teardown_trainer
from steps.rl import rl_step
from tests.steps.test_rl_ref_kl import REF_KL_TAU, off_policy_inference
from tests.steps.test_rl_step import ROWS, T, own_logprobs, random_rows, rl_batch


def share(batch, rank: int, size: int):
    """This rank's contiguous share of a batch of one-row micro-batches."""
    per_rank = len(batch.micro_batches) // size
    mine = batch.micro_batches[rank * per_rank : (rank + 1) * per_rank]
    return dataclasses.replace(batch, micro_batches=mine, num_samples=len(mine))


def without_advantages(batch):
    zero = [
        dataclasses.replace(mb, advantages=torch.zeros_like(mb.advantages))
        for mb in batch.micro_batches
    ]
    return dataclasses.replace(batch, micro_batches=tuple(zero))


def full_weights(model) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def digest(weights: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(w.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def config_of(model_dir: str, loss: RLLossConfig) -> RLConfig:
    return RLConfig(
        model=ModelConfig(name=model_dir),
        optim=OptimConfig(lr=1e-2, max_norm=1.0),
        max_steps=10,
        seq_len=T,
        batch_size=ROWS,
        micro_batch_size=1,
        loss=loss,
    )


def main(model_dir: str, reference_dir: str, out_dir: str) -> None:
    # Without the kl_tau penalty: a loss that is exactly 0 when the advantages are (the skip).
    config = config_of(model_dir, RLLossConfig(kl_tau=0.0))
    runtime = setup_trainer(config)
    rank, size = runtime.rank, runtime.world_size
    state = init_state(config, runtime)
    rows = random_rows(5)
    batch = share(rl_batch(rows, own_logprobs(state.handles.model, rows), size=1), rank, size)

    skip_rows, changed = [], []
    for step in (1, 2):
        mine = without_advantages(batch) if rank == 0 or step == 2 else batch
        before = full_weights(state.handles.model)
        state, metrics = rl_step(state, mine)
        after = full_weights(state.handles.model)
        changed.append(any(not torch.equal(a, b) for a, b in zip(after, before)))
        skip_rows.append(
            {k: float(metrics[k]) for k in ("skipped/zero_advantage", "optim/skipped")}
        )
    weights_digest = digest(full_weights(state.handles.model))

    loss = RLLossConfig(ref_kl_tau=REF_KL_TAU, ref_model=reference_dir)
    state = init_state(config_of(model_dir, loss), runtime)
    rows = random_rows(13)
    inference = off_policy_inference(state.handles.model, rows)
    _, metrics = rl_step(state, share(rl_batch(rows, inference, size=1), rank, size))
    result = {
        "rank": rank,
        "skip_rows": skip_rows,
        "changed_at_step_1": changed[0],
        "changed_at_step_2": changed[1],
        "weights_digest": weights_digest,
        "ref_row": {k: float(v) for k, v in metrics.items()},
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    teardown_trainer(runtime)
