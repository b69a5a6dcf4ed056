"""Process setup shared by every trainer. Side effects: process group, threads, matmul precision;
`setup_trainer` reads the launcher's environment ($RANK, $WORLD_SIZE, ...) and the model's
config.json.

The decisions are pure functions (`plan_parallel_dims` and `resolve_ep` from fnt.config.parallel,
`threads_per_rank`); `setup_trainer` applies them and returns a frozen Runtime record;
`teardown_trainer` undoes the process group.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from fnt.config import Config, ConfigError
from fnt.config.parallel import ParallelDims, plan_parallel_dims, resolve_ep
from fnt.model.moe import num_experts_of
from fnt.optim.offload import bind_numa_
from fnt.optim.setup import OffloadPlan, offload_plan


def threads_per_rank(cpus_available: int, local_world_size: int) -> int:
    """A fair share of this process's CPUs for each rank on the node, at least one. Pure."""
    return max(1, cpus_available // max(1, local_world_size))


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
    owns_process_group: bool = False
    """Whether setup_trainer created the process group (teardown_trainer destroys only that one;
    a group the caller made before stays theirs)."""

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
    plan = offload_plan(config.optim, device, launched, config.model.compute_dtype)
    sharing = bind_numa_(local_rank, local_world_size) if plan.bind_numa else local_world_size
    auto_threads = threads_per_rank(len(os.sched_getaffinity(0)), sharing)
    num_threads = config.runtime.num_threads or auto_threads
    torch.set_num_threads(num_threads)
    torch.set_float32_matmul_precision(config.runtime.matmul_precision)

    mesh = None
    owns_process_group = False
    if launched:
        # Free unreachable objects while the interpreter is still whole: FSDP2 modules form
        # reference cycles, so a model dropped at the end of main() is only collected during
        # interpreter shutdown, where destroying the gloo work objects it still references
        # aborts the process ("terminate called without an active exception") about one run
        # in ten. atexit handlers run before that shutdown.
        atexit.register(gc.collect)
        if not dist.is_initialized():
            owns_process_group = True
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
        owns_process_group=owns_process_group,
    )


def teardown_trainer(runtime: Runtime) -> None:
    """Destroy the process group that setup_trainer created, if any. A group that was there
    before (made by the caller, who may run several trainings in it) is left as it is."""
    if runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
