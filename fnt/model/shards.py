"""Which rows of a parameter this rank's FSDP2 shard holds. Pure. For the code that writes a
shard's rows itself: the sharded loader (fnt.model.sharded_load) and the LoRA adapters' initial
values (fnt.model.lora).

FSDP2 shards every parameter on dim 0 over the data-parallel shard dimension of the mesh, in
`torch.chunk` pieces: with n rows over k ranks, rank r holds rows [r*c, min((r+1)*c, n)) for
c = ceil(n / k).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def shard_bounds(
    rows: int, placements: Sequence[Any], coordinate: Sequence[int], mesh_sizes: Sequence[int]
) -> tuple[int, int]:
    """[start, stop) of dim 0 held at `coordinate` of a mesh by a tensor of `rows` rows placed
    with `placements` (Shard(0) in torch.chunk pieces, or Replicate). Pure."""
    from torch.distributed.tensor import Replicate, Shard

    start, stop = 0, rows
    for placement, index, size in zip(placements, coordinate, mesh_sizes, strict=True):
        if isinstance(placement, Shard) and placement.dim == 0:
            chunk = math.ceil(rows / size)
            start = min(rows, index * chunk)
            stop = min(rows, start + chunk)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"sharded loading expects dim-0 shards, got {placements}")
    return start, stop


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of dim 0 that this rank's shard of `param` holds (a plain tensor: all)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    mesh = param.device_mesh
    sizes = [mesh.size(d) for d in range(mesh.ndim)]
    return shard_bounds(param.shape[0], param.placements, mesh.get_coordinate(), sizes)
