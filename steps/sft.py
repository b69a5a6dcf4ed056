"""The SFT step function. Side effects: forward/backward, collectives and the optimizer update
on the referents of `state.handles`; it does not log, print, checkpoint or profile.

Loss: token-level cross entropy summed over the loss tokens of every micro-batch on every rank,
divided by the GLOBAL number of loss tokens of the step, so k micro-batches or n ranks give the
same gradient as one big batch.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from fnt.batch import PackedRows, SftBatch
from fnt.state import TrainState
from fnt.update import all_reduce_sum, optimizer_update_, packed_logits


def token_loss_sum(logits: Tensor, rows: PackedRows) -> Tensor:
    """Sum of cross entropy over the loss tokens (logits at t-1 predict the token at t)."""
    targets = rows.input_ids[:, 1:]
    mask = rows.loss_mask[:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none"
    )
    return (losses * mask.flatten()).sum()


def sft_step(state: TrainState, batch: SftBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches. Metrics stay tensors (no host sync).

    A micro-batch whose loss is NaN/inf is left out of the loss and counted in loss/nan_count.
    In a single process its backward is skipped. Under FSDP2 every rank must run the same
    backward collectives, so it back-propagates an all-zero surrogate instead; should the
    non-finite values still reach the gradients, the global grad norm is non-finite and the
    update is skipped on every rank (optim/skipped = 1).
    """
    batch.check()
    state.check_current()
    model, optimizer, runtime = state.handles.model, state.handles.optimizer, state.handles.runtime
    distributed = runtime.distributed
    device = runtime.device
    started = time.perf_counter()

    local = torch.tensor(
        [
            float(sum(int(mb.loss_mask[:, 1:].sum()) for mb in batch.micro_batches)),
            float(batch.num_samples),
            float(sum(mb.num_tokens for mb in batch.micro_batches)),
        ],
        dtype=torch.float64,
        device=device,
    )
    loss_tokens, samples, tokens = all_reduce_sum(local, distributed).tolist()
    # Each rank's gradient is averaged over the data-parallel ranks by FSDP2; scaling by dp
    # turns that average back into the global sum before the division by the global count.
    scale = runtime.dims.dp / max(loss_tokens, 1.0)

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    nan_count = torch.zeros((), dtype=torch.float32, device=device)
    for mb in batch.micro_batches:
        rows = PackedRows(*(t.to(device) for t in (mb.input_ids, mb.position_ids, mb.document_ids, mb.loss_mask)))
        logits = packed_logits(model, rows)
        mb_loss = token_loss_sum(logits, rows)
        if bool(torch.isfinite(mb_loss)):
            (mb_loss * scale).backward()
            loss_sum += mb_loss.detach()
        else:
            nan_count += 1
            if distributed:
                (logits.sum() * 0.0).backward()
    fwd_bwd_seconds = time.perf_counter() - started

    optim_metrics = optimizer_update_(model, optimizer, state.progress.step + 1, state.config)
    totals = all_reduce_sum(torch.stack([loss_sum, nan_count]), distributed)
    loss_mean = totals[0] / max(loss_tokens, 1.0)
    metrics = {
        "loss/mean": loss_mean,
        "loss/perplexity": torch.exp(loss_mean),
        "loss/nan_count": totals[1],
        **optim_metrics,
        "time/forward_backward": fwd_bwd_seconds,
    }
    progress = state.progress
    next_state = state.advance(
        total_tokens=progress.total_tokens + int(tokens),
        total_samples=progress.total_samples + int(samples),
        data=batch.data_after,
    )
    return next_state, metrics
