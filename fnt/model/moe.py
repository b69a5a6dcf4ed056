"""Mixture-of-experts: the model's expert counts and the load-balance statistics of its routers.
Pure, except `record_router_logits`, which registers forward hooks on the routers (and removes
them when its block ends): `num_experts_of` and `moe_top_k` read the Hugging Face config object,
`router_stats` and `moe_metrics` are tensor math, `routers` finds the routers.

For every MoE layer, the router picks the top-k experts of each token. Over one optimizer step
(all micro-batches, all ranks):

- max_vio (maximum violation) of a layer = (load of the busiest expert - mean load) / mean load,
  where an expert's load is the number of (token, slot) assignments it received and the mean
  load is tokens * k / experts. 0 means perfectly balanced; 1 means the busiest expert got twice
  its fair share. `max_vio/mean` averages it over layers.
- routing_confidence = the mean, over all assignments, of the softmax probability the router gave
  the chosen expert (before any top-k renormalization). `routing_confidence/mean` averages over
  layers. Near 1/experts the router is guessing; near 1/k (or above) it is decisive.

Every token the router sees counts, padding included, because those assignments cost expert
capacity too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn


def num_experts_of(model_config: Any) -> Optional[int]:
    """The number of routed experts of a Hugging Face config, or None for a dense model."""
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(model_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def moe_top_k(model: nn.Module) -> int:
    """Experts chosen per token by the model's routers; 0 for a dense model."""
    config = model.config
    if num_experts_of(config) is None:
        return 0
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0))


def router_stats(router_logits: Sequence[Tensor], top_k: int) -> Tensor:
    """Per-layer sums [L, E + 2]: expert loads, summed chosen probabilities, assignments."""
    rows = []
    for logits in router_logits:
        probs = torch.softmax(logits.detach().float(), dim=-1)  # [tokens, E]
        top_probs, top_experts = probs.topk(top_k, dim=-1)
        # index_add, not bincount: bincount on CUDA reads the largest index back to the host.
        chosen = top_experts.flatten()
        loads = probs.new_zeros(probs.shape[-1]).index_add_(0, chosen, probs.new_ones(chosen.shape))
        extra = torch.stack([top_probs.sum(), top_probs.new_full((), float(top_probs.numel()))])
        rows.append(torch.cat([loads, extra]))
    return torch.stack(rows)


def moe_metrics(stats: Tensor) -> dict[str, Tensor]:
    """max_vio/mean and routing_confidence/mean from summed `router_stats` (see module doc)."""
    loads, prob_sum, assignments = stats[:, :-2], stats[:, -2], stats[:, -1]
    mean_load = assignments / loads.shape[-1]
    max_vio = (loads.max(dim=-1).values - mean_load) / mean_load.clamp_min(1e-12)
    confidence = prob_sum / assignments.clamp_min(1.0)
    return {"max_vio/mean": max_vio.mean(), "routing_confidence/mean": confidence.mean()}


def routers(model: nn.Module) -> list[nn.Module]:
    """The router (`mlp.gate`) of every decoder layer whose MLP holds experts."""
    found = []
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if (
            mlp is not None
            and hasattr(mlp, "experts")
            and isinstance(getattr(mlp, "gate", None), nn.Module)
        ):
            found.append(mlp.gate)
    return found


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[Tensor]]:
    """Collect each router's logits [tokens, experts] during the forwards inside the block.

    Hooks instead of `output_router_logits=True`: the latter also computes the load-balancing
    loss, which in transformers 5 does not accept the 4-D packed-document mask.
    """
    captured: list[Tensor] = []

    def hook(module, inputs, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handles = [router.register_forward_hook(hook) for router in routers(model)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
