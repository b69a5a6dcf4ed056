"""The parts of an optimizer step that SFT and RL share. Side effects: collectives, grads, params.

A step function computes its loss and calls `backward_`, then `optimizer_update_` once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fnt.batch import PackedRows, block_causal_mask
from fnt.optim import set_lr_
from fnt.schedule import lr_at
from fnt.setup import num_experts_of


def all_reduce_sum(t: Tensor, distributed: bool) -> Tensor:
    """Sum a tensor over all ranks (identity in a single process)."""
    if distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def moe_top_k(model: nn.Module) -> int:
    """Experts chosen per token by the model's routers; 0 for a dense model."""
    config = model.config
    if num_experts_of(config) is None:
        return 0
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0))


def packed_logits(model: nn.Module, rows: PackedRows) -> Tensor:
    """Logits [B, T, V] of packed rows, documents isolated by the block-causal mask."""
    return model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        attention_mask=block_causal_mask(rows.document_ids),
    ).logits


def grad_norm_(params: list[Tensor], max_norm: float) -> Tensor:
    """The global L2 norm of the gradients; clips them to max_norm when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # a DTensor under FSDP2: reduce the shards' norms
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def optimizer_update_(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, config
) -> dict[str, Tensor | float]:
    """Set the step's LR, measure/clip the grad norm, update, zero grads. Returns optim/* metrics.

    A non-finite gradient norm skips the update on every rank (the norm is global, so all ranks
    agree), so NaN never reaches the weights.
    """
    lr = lr_at(step, config.optim.lr, config.schedule, config.max_steps)
    set_lr_(optimizer, lr)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = grad_norm_(params, config.optim.max_norm)
    finite = bool(torch.isfinite(norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"optim/lr": lr, "optim/grad_norm": norm, "optim/skipped": 0.0 if finite else 1.0}
