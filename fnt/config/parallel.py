"""The parallel plan: degrees of each parallel dimension, checked against the world size, and
the batch-layout rule. Pure.

No torch here: config validation uses the same rules on the command line, before torch is
imported; setup (fnt.distributed.runtime) applies them again once the model's number of experts is
known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from fnt.errors import ConfigError

if TYPE_CHECKING:
    from fnt.config.schema import ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp


def plan_parallel_dims(parallel: ParallelConfig, world_size: int, ep: int) -> ParallelDims:
    """Fill in dp_shard = -1 and check that the degrees multiply to the world size. Pure."""
    for name in ("dp_replicate", "cp", "tp"):
        if getattr(parallel, name) < 1:
            raise ConfigError(f"'parallel.{name}' = {getattr(parallel, name)}: must be >= 1")
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        rest = parallel.dp_replicate * parallel.cp * parallel.tp
        if world_size % rest:
            raise ConfigError(
                f"world size {world_size} is not divisible by "
                f"parallel.dp_replicate x cp x tp = {rest}"
            )
        dp_shard = world_size // rest
    elif dp_shard < 1:
        raise ConfigError(f"'parallel.dp_shard' = {dp_shard}: must be >= 1 or -1 (fill)")
    dims = ParallelDims(parallel.dp_replicate, dp_shard, parallel.cp, parallel.tp, ep)
    if dims.world_size != world_size:
        raise ConfigError(
            f"parallel dims dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x "
            f"cp={dims.cp} x tp={dims.tp} = {dims.world_size}, but the world size is {world_size}"
        )
    for name in ("cp", "tp", "ep"):
        if getattr(dims, name) != 1:
            raise ConfigError(
                f"'parallel.{name}' = {getattr(dims, name)}: only 1 is implemented "
                "(data parallelism with FSDP2 is); set it to 1"
            )
    return dims


def resolve_ep(ep: Union[int, str], num_experts: Optional[int], world_size: int) -> int:
    """Turn `parallel.ep` into an integer. Pure.

    "auto" becomes 1: expert parallelism is not implemented, so the experts are sharded by FSDP2
    like any other weight. An explicit integer must divide both the world size and the number of
    experts; `plan_parallel_dims` then rejects anything but 1 with a clear message.
    """
    if ep == "auto":
        return 1
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"'parallel.ep' = {ep!r}: expected a positive integer or \"auto\"")
    if ep > 1 and num_experts is None:
        raise ConfigError(f"'parallel.ep' = {ep}: the model has no experts")
    if ep > 1 and (num_experts % ep or world_size % ep):
        raise ConfigError(
            f"'parallel.ep' = {ep} must divide the number of experts ({num_experts}) "
            f"and the world size ({world_size})"
        )
    return ep


def batch_layout_problem(batch_size: int, micro_batch_size: int, dp_size: int) -> Optional[str]:
    """What keeps `batch_size` rows per step from splitting evenly over `dp_size` ranks and then
    into micro-batches of `micro_batch_size` rows, or None. Pure."""
    if batch_size < 1 or micro_batch_size < 1:
        return f"batch_size and micro_batch_size must be >= 1, got {batch_size}, {micro_batch_size}"
    rows = dp_size * micro_batch_size
    if batch_size % rows:
        return (
            f"batch_size={batch_size} (global rows per step) must be a multiple of dp_size * "
            f"micro_batch_size = {dp_size} * {micro_batch_size} = {rows}: a step's rows split "
            "evenly over the data-parallel ranks, then into micro-batches"
        )
    return None
