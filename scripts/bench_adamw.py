"""Benchmark one CPU AdamW step: fnt's native kernel against torch, side by side in one run.

Side effects: allocates several GiB of tensors (less with --quick), builds the native kernel on
first use, prints a table and, as its last line, one JSON object with the medians (ms) and the
ratios the issue tracker asks for:

    fp32_vs_torch_fused        torch fused / native, 1 x 50M fp32 params
    many_small_vs_torch_fused  torch fused / native, 5000 x 10K fp32 params
    mixed_vs_torch_composite   torch composite / native, 50M bf16 params with fp32 master
    fp32_fraction_of_probe     bandwidth probe / native, 1 x 50M fp32 (1.0 = at bandwidth)

The candidates of all cases are interleaved within each repetition so that machine noise
(frequency, other tenants) hits them alike; each timing is one optimizer step after warm-up.

    python scripts/bench_adamw.py [--reps 7] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fnt.native import build as _native
from fnt.optim.adamw import CPUAdamW

LR = 1e-3


@dataclass(frozen=True)
class Case:
    name: str
    count: int  # number of tensors
    numel: int  # elements per tensor
    dtype: torch.dtype


def full_cases() -> list[Case]:
    return [
        Case("fp32_1x50M", 1, 50_000_000, torch.float32),
        Case("fp32_5000x10K", 5000, 10_000, torch.float32),
        Case("bf16_1x50M", 1, 50_000_000, torch.bfloat16),
    ]


def quick_cases() -> list[Case]:
    return [
        Case("fp32_1x50M", 1, 200_000, torch.float32),
        Case("fp32_5000x10K", 50, 2_000, torch.float32),
        Case("bf16_1x50M", 1, 200_000, torch.bfloat16),
    ]


def make_params(case: Case, grads: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Fresh params of the case, each given the shared (read-only) grad tensor."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for g in grads:
        p = torch.randn(case.numel, generator=gen).to(case.dtype).requires_grad_()
        p.grad = g
        params.append(p)
    return params


def torch_optimizer_step(params: list[torch.Tensor], **kind: bool) -> Callable[[], None]:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, **kind).step


def composite_step(params: list[torch.Tensor], preallocated: bool) -> Callable[[], None]:
    """Mixed precision the torch way: fp32 grad, fused AdamW on an fp32 master, copy back.

    ``preallocated`` casts the grad into a buffer kept across steps instead of a fresh tensor.
    """
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01, fused=True)
    if preallocated:
        for m in masters:
            m.grad = torch.empty_like(m)

    def step() -> None:
        for p, m in zip(params, masters, strict=True):
            if preallocated:
                m.grad.copy_(p.grad)
            else:
                m.grad = p.grad.float()
        opt.step()
        torch._foreach_copy_([p.detach() for p in params], masters)

    return step


def probe_step(case: Case, grads: list[torch.Tensor]) -> Callable[[], None]:
    """AdamW-shaped fp32 traffic (read p, g, m, v; write p, m, v), same threading as native."""
    kernel = _native.load().stream_probe_
    p = [torch.zeros(case.numel) for _ in grads]
    m = [torch.zeros(case.numel) for _ in grads]
    v = [torch.zeros(case.numel) for _ in grads]
    g32 = [g.float() for g in grads]
    return lambda: kernel(p, g32, m, v)


def candidates(case: Case) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(case.numel, generator=gen).to(case.dtype) for _ in range(case.count)]
    out: dict[str, Callable[[], None]] = {
        "native": CPUAdamW(make_params(case, grads, 1), lr=LR, impl="native").step,
    }
    if case.dtype == torch.float32:
        out["torch_fused"] = torch_optimizer_step(make_params(case, grads, 2), fused=True)
        out["torch_foreach"] = torch_optimizer_step(make_params(case, grads, 3), foreach=True)
        out["torch_forloop"] = torch_optimizer_step(
            make_params(case, grads, 4), foreach=False, fused=False
        )
        out["probe"] = probe_step(case, grads)
    else:
        out["torch_composite"] = composite_step(make_params(case, grads, 5), preallocated=False)
        out["torch_composite_prealloc"] = composite_step(
            make_params(case, grads, 6), preallocated=True
        )
    return out


def time_ms(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (median taken)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cases = quick_cases() if args.quick else full_cases()
    runs = {case.name: candidates(case) for case in cases}
    for fns in runs.values():
        for fn in fns.values():
            fn()  # warm-up: lazy state init, first-touch page faults
    times: dict[str, dict[str, list[float]]] = {
        name: {cand: [] for cand in fns} for name, fns in runs.items()
    }
    for rep in range(args.reps):
        for name, fns in runs.items():
            order = list(fns)
            # Rotate who goes first so no candidate always runs on a cache warmed by another.
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for cand in order:
                times[name][cand].append(time_ms(fns[cand]))

    med = {
        name: {cand: round(statistics.median(ts), 3) for cand, ts in by_cand.items()}
        for name, by_cand in times.items()
    }
    print(f"threads={torch.get_num_threads()} reps={args.reps} (median ms of one step)")
    print(f"{'case':<16}{'candidate':<26}{'median ms':>11}{'min ms':>9}{'vs native':>11}")
    for name, by_cand in times.items():
        for cand, ts in by_cand.items():
            rel = med[name][cand] / med[name]["native"]
            print(f"{name:<16}{cand:<26}{med[name][cand]:>11.2f}{min(ts):>9.2f}{rel:>10.2f}x")
    fp32, small, mixed = (med[c.name] for c in cases)
    result = {
        "median_ms": med,
        # Minima show the uncontended speed when other processes share the cores.
        "min_ms": {
            name: {cand: round(min(ts), 3) for cand, ts in by_cand.items()}
            for name, by_cand in times.items()
        },
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "quick": args.quick,
        "fp32_vs_torch_fused": round(fp32["torch_fused"] / fp32["native"], 3),
        "many_small_vs_torch_fused": round(small["torch_fused"] / small["native"], 3),
        "mixed_vs_torch_composite": round(mixed["torch_composite"] / mixed["native"], 3),
        "fp32_fraction_of_probe": round(fp32["probe"] / fp32["native"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
