"""A few `fnt sft` steps under torch.profiler: where a step's device time goes and how often it
waits on the device. Side effects: writes the model (scripts/bench_throughput.py's write_model),
the rows (scripts/bench_peers.py's: one document of exactly seq_len tokens a step), the run and
its trace (trace.json.gz) under --work; runs fnt's driver in this process.

    python scripts/profile_step.py [--seq-len 8192] [--warmup 3] [--steps 3] [--work DIR]
        [--model DIR] [--tiny] [--top 15]

The run is the fnt side of scripts/bench_peers.py (batch 1, micro-batch 1, bfloat16 compute
over float32 weights on CUDA, fnt's own defaults for model.attn_implementation and
model.compile), driven by fnt.loop.run: the profiler starts and stops in its on_state hook,
after --warmup steps (compiling, if fnt compiles, happens there) and after --steps more, so the
window holds those steps whole, each with the driver's work around it (its metrics brought back,
its row); the device is synchronized before the window starts and before it stops (that one
cudaDeviceSynchronize is left out of the counts).

Printed: the top --top kernels by total device time (on a machine without CUDA: the top CPU
ops by self time), and per step the host syncs: the ops aten::_local_scalar_dense (what .item()
and float(tensor) run), aten::item, aten::is_nonzero (bool(tensor)), aten::nonzero, the CUDA
runtime's cudaStreamSynchronize and cudaDeviceSynchronize, and device-to-host copies (Memcpy
DtoH). `host_syncs_per_step` is the blocking waits: cudaStreamSynchronize +
cudaDeviceSynchronize on CUDA, aten::_local_scalar_dense + aten::nonzero on CPU. Last line: one
JSON object. `--tiny` is the CPU-sized check of the same path (tiny shape, seq_len 256).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_peers import fnt_args, write_rows  # noqa: E402
from scripts.bench_throughput import write_model  # noqa: E402

SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")
SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def profile_run(spec: dict, warmup: int, steps: int, trace: Path) -> list[tuple[str, float, int]]:
    """fnt's driver over warmup + steps steps, the profiler on for the last `steps`; writes the
    trace and returns the CPU ops by self time (name, microseconds, calls), the most first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fnt.apps.cli import parse_config
    from fnt.config import Config
    from fnt.loop import run
    from fnt.sources import sft_source
    from steps import sft_step

    config, _ = parse_config(fnt_args({**spec, "steps": warmup + steps}), Config)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=False, with_stack=False)

    def window(state) -> None:  # after each step, before its row (fnt.loop.run's on_state)
        step = state.progress.step
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            prof.start()
        elif step == warmup + steps:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()

    run(config, sft_step, sft_source, on_state=window)
    prof.export_chrome_trace(str(trace))
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total, e.count) for e in averages]


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], steps: int, cpu_ops, top: int, cuda: bool) -> dict:
    """The top kernels (or CPU ops) and the host syncs per step of a trace's events."""
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    counts = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "kernel":
            kernels[name][0] += float(e.get("dur", 0.0))
            kernels[name][1] += 1
        elif cat == "cpu_op" and name in SYNC_OPS:
            counts[name] += 1
        elif cat in ("cuda_runtime", "cuda_driver") and name in SYNC_RUNTIME:
            counts[name] += 1
        elif cat == "gpu_memcpy" and "DtoH" in name:
            counts["Memcpy DtoH"] += 1
    if cuda and counts["cudaDeviceSynchronize"]:
        counts["cudaDeviceSynchronize"] -= 1  # the window's own, before it stops
    device_total = sum(v[0] for v in kernels.values())
    if kernels:
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        listed = [
            {
                "name": name,
                "ms_per_step": total / 1e3 / steps,
                "share": total / device_total if device_total else 0.0,
                "calls_per_step": calls / steps,
            }
            for name, (total, calls) in ranked
        ]
    else:
        cpu_total = sum(t for _, t, _ in cpu_ops)
        listed = [
            {
                "name": name,
                "ms_per_step": total / 1e3 / steps,
                "share": total / cpu_total if cpu_total else 0.0,
                "calls_per_step": calls / steps,
            }
            for name, total, calls in cpu_ops[:top]
        ]
    per_step = {name: counts[name] / steps for name in (*SYNC_OPS, *SYNC_RUNTIME, "Memcpy DtoH")}
    blocking = SYNC_RUNTIME if cuda else ("aten::_local_scalar_dense", "aten::nonzero")
    return {
        "top": listed,
        "top_of": "kernels by device time" if kernels else "CPU ops by self time",
        "device_ms_per_step": device_total / 1e3 / steps if kernels else None,
        "syncs_per_step": per_step,
        "host_syncs_per_step": sum(per_step[name] for name in blocking),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=None, help="8192 (--tiny: 256)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the window (3)")
    parser.add_argument("--steps", type=int, default=None, help="steps profiled (3; --tiny 2)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None, help="a model written already")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model and row")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    shape = "tiny" if args.tiny else "0.6b"
    seq_len = args.seq_len or (256 if args.tiny else 8192)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    steps = args.steps or (2 if args.tiny else 3)
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-profile-step-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or write_model(work / f"qwen3-{shape}", shape)
    chats, _ = write_rows(work, model, seq_len, warmup + steps)
    run = work / f"run-seq{seq_len}"
    if run.exists():
        import shutil

        shutil.rmtree(run)
    spec = {"model": str(model), "out": str(run), "seq_len": seq_len, "chats": str(chats)}
    spec["dtype"] = "bfloat16" if cuda else "float32"
    trace = work / "trace.json.gz"
    cpu_ops = profile_run(spec, warmup, steps, trace)
    summary = summarize(read_trace(trace), steps, cpu_ops, args.top, cuda)
    config = json.loads((run / "config.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    result = {
        "bench": "profile_step",
        "shape": shape,
        "seq_len": seq_len,
        "warmup": warmup,
        "steps": steps,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "attn_implementation": config["model"]["attn_implementation"],
        "compile": config["model"]["compile"],
        "step_s": [r["time/step"] for r in rows[warmup:]],
        "trace": str(trace),
        **summary,
    }
    print(f"{summary['top_of']}, per step over {steps} steps after {warmup}:")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  name")
    for k in summary["top"]:
        calls, name = k["calls_per_step"], k["name"][:90]
        print(f"{k['ms_per_step']:9.3f} {k['share']:6.1%} {calls:6.1f}  {name}")
    syncs = summary["syncs_per_step"].items()
    print("host syncs per step: " + ", ".join(f"{n} {v:g}" for n, v in syncs))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
