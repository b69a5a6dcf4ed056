"""The torch profiler window. Side effects: starts/stops the profiler, writes trace files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile


def trace_file(trace_path: str, rank: int) -> Path:
    return Path(trace_path) / f"trace_{rank}.json.gz"


def start_trace(trace_path: Optional[str]) -> Optional[profile]:
    """Start profiling CPU (and CUDA when available) activity; None when tracing is off."""
    if not trace_path:
        return None
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    prof.start()
    return prof


def save_trace(
    prof: Optional[profile], trace_path: Optional[str], rank: Optional[int] = None
) -> Optional[Path]:
    """`save_trace_` as the seed calls it, `save_trace(prof, trace_path)`: the rank is
    torchrun's (RANK, 0 in a plain process) unless given."""
    return save_trace_(prof, trace_path, int(os.environ.get("RANK", 0)) if rank is None else rank)


def save_trace_(prof: Optional[profile], trace_path: Optional[str], rank: int) -> Optional[Path]:
    """Stop the profiler and write `trace_path/trace_{rank}.json.gz` (a gzipped Chrome trace)."""
    if prof is None or not trace_path:
        return None
    prof.stop()
    path = trace_file(trace_path, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path
