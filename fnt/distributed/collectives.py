"""The collectives the rest of fnt shares; each is the identity in a single process. Side
effects: collectives across the data-parallel ranks (gloo on CPU, nccl on CUDA).

Every rank must call each of them at the same point with the same shapes, or the ranks hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from fnt.distributed.runtime import Runtime


def all_reduce_sum(t: Tensor, distributed: bool) -> Tensor:
    """Sum a tensor over all ranks, in place (identity in a single process); returns it."""
    if distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_sums(values: Sequence[float], runtime: Runtime) -> list[float]:
    """The sum of each value over all ranks (the values themselves in one process, with no
    tensor, so nothing is read back from a device). Float64 on the way."""
    if not runtime.distributed:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: Sequence[float], runtime: Runtime) -> list[float]:
    """The largest of each value over all ranks (the values themselves in one process).

    Float64 on the way, which holds counts exactly up to 2**53."""
    if not runtime.distributed:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_objects(obj: Any, distributed: bool) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank (`[obj]` in one process)."""
    if not distributed:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, runtime: Runtime) -> Any:
    """Rank 0's `obj` (picklable) on every rank (`obj` itself in one process); what the other
    ranks pass is ignored."""
    if not runtime.distributed:
        return obj
    box = [obj if runtime.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_state_dict(
    model: nn.Module, *, cpu_offload: bool = False, trained_only: bool = False
) -> dict[str, Tensor]:
    """The model's full (unsharded) state dict, gathered from its FSDP2 shards on every rank
    (on the CPU with `cpu_offload`, where only rank 0 keeps the tensors); a plain model's own
    state dict in one process. `trained_only`: without the frozen parameters (a LoRA model's
    base), which then are not gathered at all."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(
        full_state_dict=True, cpu_offload=cpu_offload, ignore_frozen_params=trained_only
    )
    return get_model_state_dict(model, options=options)
