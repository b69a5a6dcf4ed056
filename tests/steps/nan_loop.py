"""A research-style loop on the library API with odd micro-batches on one rank.

A two-rank job (tests/two_ranks.py); rank 0's first micro-batch of step 1 gets NaN logits. At
step 2 rank 1's last micro-batch has no loss tokens: rank 1 must still run it, since rank 0 runs
two. Each rank writes what the test checks to OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fnt import fold, init_state, sft_source
from fnt.config import Config, ModelConfig
from fnt.distributed.runtime import setup_trainer, teardown_trainer
from steps.sft import sft_step


def poison_first_call_(model, enabled: bool) -> list[int]:
    """Hook the lm head; returns the list its calls are counted into."""
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += 1
        # Adding a constant NaN keeps the gradient path finite (d out / d logits = 1).
        return output + float("nan") if enabled and calls[0] == 1 else output

    model.lm_head.register_forward_hook(hook)
    return calls


def without_loss_at_the_end(batch):
    rows = batch.micro_batches[-1]
    empty = dataclasses.replace(rows, loss_mask=torch.zeros_like(rows.loss_mask))
    return dataclasses.replace(batch, micro_batches=(*batch.micro_batches[:-1], empty))


def main(model_dir: str, out_dir: str) -> None:
    config = Config(
        model=ModelConfig(name=model_dir), max_steps=2, batch_size=4, micro_batch_size=1, seq_len=32
    )
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    forwards = poison_first_call_(state.handles.model, enabled=runtime.rank == 0)

    def source(state):
        # Rank 1's second step ends with a micro-batch without loss tokens.
        batch = sft_source(state)
        if runtime.rank == 1 and state.progress.step == 1:
            return without_loss_at_the_end(batch)
        return batch

    rows = []
    for state, metrics in fold(state, source, sft_step, 2):
        rows.append({k: float(v) for k, v in metrics.items() if k.startswith(("loss/", "optim/"))})
    finite = all(
        bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
        for p in state.handles.model.parameters()
    )
    result = {"rank": runtime.rank, "rows": rows, "weights_finite": finite, "forwards": forwards[0]}
    (Path(out_dir) / f"rank{runtime.rank}.json").write_text(json.dumps(result))
    teardown_trainer(runtime)
