"""The SFT step function. Side effects: forward/backward, collectives and the optimizer update
on the referents of `state.handles`; it does not log, print, checkpoint or profile.

Loss: token-level cross entropy summed over the loss tokens of every micro-batch on every rank,
divided by the GLOBAL number of loss tokens of the step, so k micro-batches or n ranks give the
same gradient as one big batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fnt.batch import PackedRows, SftBatch
from fnt.setup import Runtime
from fnt.state import TrainState
from fnt.moe import moe_metrics, record_router_logits, router_stats
from fnt.update import all_reduce_sum, moe_top_k, optimizer_update_, packed_logits


def token_loss_sum(logits: Tensor, rows: PackedRows) -> Tensor:
    """Sum of cross entropy over the loss tokens (logits at t-1 predict the token at t)."""
    targets = rows.input_ids[:, 1:]
    mask = rows.loss_mask[:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none"
    )
    return (losses * mask.flatten()).sum()


@dataclass(frozen=True)
class BackwardTotals:
    """Global sums over ranks and micro-batches of one step's forward/backward."""

    loss_sum: Tensor  # [] float32, cross entropy summed over finite micro-batches
    nan_count: Tensor  # [] float32, micro-batches left out for a non-finite loss
    loss_tokens: float
    samples: float
    tokens: float
    moe_stats: Optional[Tensor]  # [L, E + 2] summed router statistics (fnt.moe), None if dense


def sft_backward_(model: nn.Module, batch: SftBatch, runtime: Runtime) -> BackwardTotals:
    """Accumulate into `.grad` the gradient of (global loss sum / global loss-token count).

    A micro-batch whose loss is NaN/inf is left out of the loss and counted. In a single process
    its backward is skipped. Under FSDP2 every rank must run the same backward collectives, so it
    back-propagates an all-zero surrogate instead; should non-finite values still reach the
    gradients, the global grad norm is non-finite and `optimizer_update_` skips the update.
    """
    device, distributed = runtime.device, runtime.distributed
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
    # FSDP2 averages gradients over the data-parallel ranks; scaling by dp turns that average
    # back into the global sum before the division by the global count.
    scale = runtime.dims.dp / max(loss_tokens, 1.0)

    top_k = moe_top_k(model)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    nan_count = torch.zeros((), dtype=torch.float32, device=device)
    moe_stats = None
    for mb in batch.micro_batches:
        rows = PackedRows(*(t.to(device) for t in (mb.input_ids, mb.position_ids, mb.document_ids, mb.loss_mask)))
        with record_router_logits(model) as router_logits:
            logits = packed_logits(model, rows)
        if top_k:
            stats = router_stats(router_logits, top_k)
            moe_stats = stats if moe_stats is None else moe_stats + stats
        mb_loss = token_loss_sum(logits, rows)
        if bool(torch.isfinite(mb_loss)):
            (mb_loss * scale).backward()
            loss_sum += mb_loss.detach()
        else:
            nan_count += 1
            if distributed:
                (logits.sum() * 0.0).backward()
    totals = all_reduce_sum(torch.stack([loss_sum, nan_count]), distributed)
    if moe_stats is not None:
        moe_stats = all_reduce_sum(moe_stats, distributed)
    return BackwardTotals(totals[0], totals[1], loss_tokens, samples, tokens, moe_stats)


def sft_step(state: TrainState, batch: SftBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches. Metrics stay tensors (no host sync)."""
    batch.check()
    state.check_current()
    model, optimizer, runtime = state.handles.model, state.handles.optimizer, state.handles.runtime
    started = time.perf_counter()
    totals = sft_backward_(model, batch, runtime)
    fwd_bwd_seconds = time.perf_counter() - started
    optim_metrics = optimizer_update_(model, optimizer, state.progress.step + 1, state.config)
    loss_mean = totals.loss_sum / max(totals.loss_tokens, 1.0)
    metrics = {
        "loss/mean": loss_mean,
        "loss/perplexity": torch.exp(loss_mean),
        "loss/nan_count": totals.nan_count,
        **optim_metrics,
        "time/forward_backward": fwd_bwd_seconds,
        **(moe_metrics(totals.moe_stats) if totals.moe_stats is not None else {}),
        **batch.metrics,
    }
    progress = state.progress
    next_state = state.advance(
        total_tokens=progress.total_tokens + int(totals.tokens),
        total_samples=progress.total_samples + int(totals.samples),
        data=batch.data_after,
    )
    return next_state, metrics
