"""NUMA placement of a rank that offloads optimizer work to the CPU.
Pure apart from reading sysfs: `parse_cpulist`, `numa_node_of`, `node_cpus`, `numa_binding`.
Side effects: `bind_numa_` sets this process's CPU affinity.

With offload the CPU AdamW streams every weight, gradient and moment through host memory once per
step, so a rank runs best on the cores (and the memory) of the NUMA node its GPU hangs off: the
pinned host buffers are then local to both the copy engine and the optimizer threads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

SYSFS = Path("/sys")


def parse_cpulist(text: str) -> frozenset[int]:
    """CPUs of a sysfs cpulist such as ``0-3,8-11,16`` (empty text: no CPUs)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def numa_node_of(sysfs: Path, bus_id: str) -> Optional[int]:
    """NUMA node of a PCI device (``0000:17:00.0``); None when unknown (-1 or no file)."""
    path = sysfs / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(sysfs: Path, node: int) -> frozenset[int]:
    """CPUs of a NUMA node (empty when sysfs does not say)."""
    try:
        return parse_cpulist(
            (sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text()
        )
    except OSError:
        return frozenset()


def numa_binding(
    sysfs: Path, bus_ids: list[str], local_rank: int, allowed: frozenset[int]
) -> tuple[frozenset[int], int]:
    """CPUs for local rank ``local_rank`` and how many local ranks share them.

    ``bus_ids[i]`` is the PCI address of local rank i's GPU and ``allowed`` the CPUs this process
    may use (a container may allow fewer than the node has). Falls back to ``allowed`` shared by
    every local rank when the GPU's node is unknown or none of its CPUs is allowed.
    """
    nodes = [numa_node_of(sysfs, bus_id) for bus_id in bus_ids]
    node = nodes[local_rank]
    cpus = frozenset() if node is None else node_cpus(sysfs, node) & allowed
    if not cpus:
        return allowed, len(bus_ids)
    return cpus, sum(1 for n in nodes if n == node)


def pci_bus_id(device_index: int) -> str:
    """sysfs name of a CUDA device's PCI function, e.g. ``0000:17:00.0``."""
    props = torch.cuda.get_device_properties(device_index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def bind_numa_(local_rank: int, local_world_size: int, sysfs: Path = SYSFS) -> int:
    """Pin this process to its GPU's NUMA node; returns how many local ranks share those CPUs
    (the ranks whose GPUs sit on that node), which divides them into thread counts."""
    bus_ids = [pci_bus_id(i) for i in range(local_world_size)]
    cpus, sharing = numa_binding(sysfs, bus_ids, local_rank, frozenset(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, cpus)
    return sharing
