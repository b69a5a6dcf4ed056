"""Process setup shared by every trainer. Side effects: process group, threads, matmul precision.

The decisions are pure functions (`plan_parallel_dims`, `resolve_ep`, `threads_per_rank`);
`setup_trainer` applies them and returns a frozen Runtime record; `teardown_trainer` undoes the
process group.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from fnt.config import Config, ConfigError, ParallelConfig
from fnt.optim.offload import bind_numa_
from fnt.optim.setup import OffloadPlan, offload_plan


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


def threads_per_rank(cpus_available: int, local_world_size: int) -> int:
    """A fair share of this process's CPUs for each rank on the node, at least one. Pure."""
    return max(1, cpus_available // max(1, local_world_size))


def num_experts_of(model_config: Any) -> Optional[int]:
    """The number of routed experts of a Hugging Face config, or None for a dense model."""
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(model_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class Runtime:
    """Facts about this process after setup; frozen."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool
    """True when a process group is up (launched by torchrun)."""
    dims: ParallelDims
    mesh: Any
    """The data-parallel DeviceMesh (dp_replicate, dp_shard), or None in a single process."""
    num_threads: int
    offload: OffloadPlan
    """How the model and optimizer state are offloaded (fnt.optim.setup.offload_plan)."""

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.dims.cp * self.dims.tp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_trainer(config: Config, seq_len: Optional[int] = None) -> Runtime:
    """Initialize the process for training and return the Runtime record.

    Works under torchrun (any world size) and as a plain `python` process (world size 1, no
    process group). Checks the parallel plan and the sequence length against the model config
    before any weight is loaded.
    """
    from transformers import AutoConfig

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    model_config = AutoConfig.from_pretrained(config.model.name)
    ep = resolve_ep(config.parallel.ep, num_experts_of(model_config), world_size)
    dims = plan_parallel_dims(config.parallel, world_size, ep)
    seq_len = config.seq_len if seq_len is None else seq_len
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(
            f"'seq_len' = {seq_len} exceeds the model's max_position_embeddings ({max_positions})"
        )

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # With offload on CUDA the rank is pinned to its GPU's NUMA node first, so the CPU AdamW
    # threads and the pinned host buffers sit next to the GPU; the default thread count is then
    # a share of that node. An explicit runtime.num_threads always wins.
    plan = offload_plan(config.optim, device, launched)
    sharing = bind_numa_(local_rank, local_world_size) if plan.bind_numa else local_world_size
    auto_threads = threads_per_rank(len(os.sched_getaffinity(0)), sharing)
    num_threads = config.runtime.num_threads or auto_threads
    torch.set_num_threads(num_threads)
    torch.set_float32_matmul_precision(config.runtime.matmul_precision)

    mesh = None
    if launched:
        # Free unreachable objects while the interpreter is still whole: FSDP2 modules form
        # reference cycles, so a model dropped at the end of main() is only collected during
        # interpreter shutdown, where destroying the gloo work objects it still references
        # aborts the process ("terminate called without an active exception") about one run
        # in ten. atexit handlers run before that shutdown.
        atexit.register(gc.collect)
        if not dist.is_initialized():
            # On CUDA, gloo serves the collectives over CPU tensors (e.g. the gradient norm of
            # CPU-offloaded shards); nccl serves everything on the GPU.
            dist.init_process_group(
                backend="cuda:nccl,cpu:gloo" if use_cuda else "gloo",
                timeout=datetime.timedelta(seconds=config.runtime.dist_timeout_s),
                device_id=device if use_cuda else None,
            )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type,
            (dims.dp_replicate, dims.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
    return Runtime(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device,
        distributed=launched,
        dims=dims,
        mesh=mesh,
        num_threads=num_threads,
        offload=plan,
    )


def teardown_trainer(runtime: Runtime) -> None:
    """Destroy the process group set up by setup_trainer, if any."""
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()
