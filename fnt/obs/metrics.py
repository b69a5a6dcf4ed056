"""Metric rows: pure builders of the metric groups and their merge into one row per step (the
driver's fnt.rows puts them together), and `to_floats`, the one host sync of a step's metrics.
Pure, except reading the disk usage and the peak memory.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

GIB = 1024**3


class MetricCollision(ValueError):
    """Two metric groups produced the same key; merging would silently drop one value."""


def merge_metrics(*groups: Mapping[str, float]) -> dict[str, float]:
    """The union of the groups; a key present in two groups raises MetricCollision. Pure."""
    row: dict[str, float] = {}
    for group in groups:
        for key, value in group.items():
            if key in row:
                raise MetricCollision(f"metric {key!r} is produced by two groups")
            row[key] = value
    return row


def step_row(step: int, time: float, *groups: Mapping[str, float]) -> dict[str, Any]:
    """One metrics row: `step`, `time` and the merged groups. Pure."""
    return merge_metrics({"step": step, "time": time}, *groups)


def perf_metrics(
    tokens: int,
    step_seconds: float,
    world_size: int,
    flops_per_token: float,
    peak_flops_per_device: float,
    peak_memory_gib: float,
) -> dict[str, float]:
    """perf/* for one step: global and per-rank tokens per second, MFU, peak memory. Pure."""
    throughput = tokens / step_seconds if step_seconds > 0 else 0.0
    achieved = throughput * flops_per_token / world_size
    return {
        "perf/throughput": throughput,
        "perf/throughput_per_rank": throughput / world_size,
        "perf/mfu": achieved / peak_flops_per_device if peak_flops_per_device > 0 else 0.0,
        "perf/peak_memory": peak_memory_gib,
    }


def disk_metrics_from_usage(total: int, used: int, free: int) -> dict[str, float]:
    """system/ckpt_disk_* from byte counts. Pure."""
    return {
        "system/ckpt_disk_free_gib": free / GIB,
        "system/ckpt_disk_used_gib": used / GIB,
        "system/ckpt_disk_total_gib": total / GIB,
        "system/ckpt_disk_free_ratio": free / total if total else 0.0,
    }


def disk_metrics(path: Path) -> dict[str, float]:
    """system/ckpt_disk_* of the filesystem that holds (or will hold) `path`."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    return disk_metrics_from_usage(usage.total, usage.used, usage.free)


def flops_per_token(
    num_params: int, num_layers: int, hidden_size: int, seq_len: int, frozen_params: int = 0
) -> float:
    """Training FLOPs per token: 6 per trained parameter, 4 per frozen one (of num_params),
    plus causal attention scores. Pure.

    A frozen weight (a LoRA base) gets no weight gradient, but the backward still passes the
    activations' gradient through it: forward 2, backward 2. The attention term is
    12 * layers * hidden * seq_len halved for the causal mask (forward 2 matmuls x 2 FLOPs,
    backward twice that).
    """
    trained = num_params - frozen_params
    return 6.0 * trained + 4.0 * frozen_params + 6.0 * num_layers * hidden_size * seq_len


_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_flops_per_device(configured_tflops: float, device: torch.device) -> float:
    """Peak dense bf16 FLOP/s of one device: the configured value, a CUDA table, or 1 TFLOP/s."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return 1e12


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory, or the max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


class Elapsed:
    """Seconds of a stretch of a step, read once the step has run (`float()`): on CUDA, between
    two events recorded in the device's queue, since a step queues its work and returns before
    it runs; elsewhere, the wall clock between start and `stop_`."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.events[0].record()
        self.started, self.seconds = time.perf_counter(), None

    def stop_(self) -> Elapsed:
        if self.events is not None:
            self.events[1].record()
        self.seconds = time.perf_counter() - self.started
        return self

    def __float__(self) -> float:
        if self.events is None:
            return float(self.seconds)
        start, end = self.events
        end.synchronize()  # done already once the step's metrics came back (to_floats)
        return start.elapsed_time(end) / 1000.0


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Turn tensor metrics into floats with one transfer per device: the tensors of each device
    are stacked there and copied back at once, the one host sync of a step. Other values (such
    as Elapsed, which reads its events then) are converted after it."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[str]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(key)
    for keys in by_device.values():
        stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
        out.update(zip(keys, stacked.cpu().tolist()))
    out.update({k: float(v) for k, v in metrics.items() if k not in out})
    return {k: out[k] for k in metrics}


def finite_or_none(value: float) -> Optional[float]:
    """NaN and infinity become None, written as JSON null. Pure."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
