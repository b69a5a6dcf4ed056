"""Chunked vs full-logits gradients under FSDP2: a two-rank job (tests/two_ranks.py) with
OUT_DIR MODEL_DIR...

For each model directory (an untied and a tied head), each rank accumulates the gradients of its
own SFT and RL batches twice, in chunks of CHUNK loss tokens and from the full logits, and
compares the global loss sums, metric sums, grad norms and full gradients. The poisoned variant
makes rank 0's first micro-batch non-finite, so that rank back-propagates zeros while rank 1
back-propagates its real loss. Each rank writes OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fnt import init_state
from fnt.config import Config, ModelConfig, RLLossConfig
from fnt.data.synthetic import synthetic_rows
from fnt.distributed.runtime import setup_trainer, teardown_trainer
from fnt.update import accumulate_gradients_, grad_norm_
from steps.rl import rl_gradients_
from steps.sft import sft_loss
from tests.steps.test_rl_step import random_rows, rl_batch
from tests.steps.test_sft import batch_of

CHUNK = 5  # divides neither the SFT nor the RL micro-batches' loss-token counts
LOSS_CONFIG = RLLossConfig(eps_low=0.2, eps_high=0.28, kl_tau=0.1)


def poison_first_call_(model, enabled: bool):
    """A forward hook on the LM head that makes the first output of a run NaN on this rank."""
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += 1
        return output + float("nan") if enabled and calls[0] == 1 else output

    return model.lm_head.register_forward_hook(hook)


def run(model, accumulate, poisoned: bool, rank: int):
    handle = poison_first_call_(model, poisoned and rank == 0)
    try:
        totals = accumulate()
    finally:
        handle.remove()
    params = list(model.parameters())
    norm = float(grad_norm_(params, 0.0))
    grads = [p.grad.full_tensor() for p in params]  # a collective: every rank, the same order
    model.zero_grad(set_to_none=True)
    return totals, norm, grads


def compare(model, batch_for, accumulate_for, rank: int) -> list[dict]:
    out = []
    for poisoned in (False, True):
        batch = batch_for(model)
        (c, c_norm, c_grads), (f, f_norm, f_grads) = (
            run(model, lambda: accumulate_for(model, batch, chunk), poisoned, rank)
            for chunk in (CHUNK, 0)
        )
        sums_diff = [abs(float(c.sums[k]) - float(v)) for k, v in f.sums.items()]
        out.append(
            {
                "poisoned": poisoned,
                "loss_tokens": f.loss_tokens,
                "nan_count": float(c.nan_count),
                "loss_sum": float(f.loss_sum),
                "grad_norm": f_norm,
                "loss_sum_diff": abs(float(c.loss_sum) - float(f.loss_sum)),
                "sums_max": max((abs(float(v)) for v in f.sums.values()), default=0.0),
                "sums_max_diff": max(sums_diff, default=0.0),
                "grad_norm_diff": abs(c_norm - f_norm) if math.isfinite(c_norm) else math.inf,
                "grad_max_diff": max(float((a - b).abs().max()) for a, b in zip(c_grads, f_grads)),
            }
        )
    return out


def main(out_dir: str, *model_dirs: str) -> None:
    config = Config(model=ModelConfig(name=model_dirs[0]), seq_len=32)
    runtime = setup_trainer(config)
    rank = runtime.rank
    sft_rows, _ = synthetic_rows(seed=rank, step=1, num_rows=4, seq_len=32)
    rl_rows = random_rows(10 + rank)
    gen = torch.Generator().manual_seed(rank)
    noise = 0.3 * torch.randn(rl_rows.input_ids.shape, generator=gen)

    def sft_accumulate(model, batch, chunk):
        return accumulate_gradients_(model, batch, runtime, sft_loss, chunk_tokens=chunk)

    def rl_accumulate(model, batch, chunk):
        return rl_gradients_(model, batch, runtime, LOSS_CONFIG, chunk)

    def rl_batch_for(model):
        inference = -math.log(model.config.vocab_size) + noise
        return rl_batch(rl_rows, inference, size=2)

    cases = []
    for model_dir in model_dirs:
        state = init_state(Config(model=ModelConfig(name=model_dir), seq_len=32), runtime)
        model = state.handles.model
        for loss, batch_for, accumulate in (
            ("sft", lambda _: batch_of(sft_rows, 2), sft_accumulate),
            ("rl", rl_batch_for, rl_accumulate),
        ):
            for case in compare(model, batch_for, accumulate, rank):
                cases.append({"model": model_dir, "loss": loss, **case})
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "cases": cases}))
    teardown_trainer(runtime)
