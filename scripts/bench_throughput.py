"""SFT throughput of `fnt sft` at a real shape: a Qwen3-0.6B-shaped model with random weights,
bfloat16 compute over float32 masters, one packed row of seq_len tokens per step, a varlen
flash-attention kernel when one is installed (else sdpa). Side effects: writes the model and a
run directory under --work, runs `python -m fnt sft` in a subprocess.

    python scripts/bench_throughput.py [--seq-len 8192] [--steps 6] [--work DIR]
        [--tiny | --medium] [--compile]

`--tiny` shrinks the model (2 layers, hidden 64) and the row (256 tokens) so that the whole
path runs in seconds on a CPU; `--medium` is a ~50M Qwen3 shape (hidden 512, 8 layers, vocab
32k). Prints the steady-state numbers (steps after the first) and, last, one JSON line.

`--compile` runs the same steps twice in one invocation, eager and with model.compile, and
prints both steady-state step times, the compile seconds (the rows' time/compile) and the
break-even step count: after how many steps the compiled run has made up its compile time
(compile seconds over the per-step saving; null when compiled steps are not faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=151_936),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32_000),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151_936),
}  # fmt: skip


def qwen3_config(shape: str):
    from transformers import Qwen3Config

    return Qwen3Config(max_position_embeddings=32_768, tie_word_embeddings=True, **SHAPES[shape])


def write_model(out: Path, shape: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from fnt.model.tiny_model import byte_level_tokenizer

    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.float32)
        model.save_pretrained(out)
        byte_level_tokenizer().save_pretrained(out)
    return out


def attention_kernel() -> str:
    """flash_attention_2 when flash-attn is installed (it needs CUDA), else sdpa."""
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", type=Path, default=None)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="a CPU-sized model and row")
    size.add_argument("--medium", action="store_true", help="a ~50M Qwen3 shape, 256 tokens")
    parser.add_argument("--compile", action="store_true", help="eager vs model.compile")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "medium" if args.medium else "0.6b"
    seq_len = args.seq_len if shape == "0.6b" else 256
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-throughput-"))
    model = write_model(work / f"qwen3-{shape}", shape)
    kernel = attention_kernel()
    if args.compile:
        compare_compile(work, model, shape, seq_len, args.steps, kernel)
        return
    result = {"shape": shape, **measure(work / "run", model, seq_len, args.steps, kernel)}
    print(
        f"seq_len {seq_len}, {kernel}: {result['tokens_per_second']:.0f} tokens/s, "
        f"MFU {result['mfu']:.3f}, {result['step_seconds']:.2f} s/step, "
        f"peak {result['peak_memory_gib']:.2f} GiB"
    )
    print(json.dumps(result))


def compare_compile(work: Path, model: Path, shape: str, seq_len: int, steps: int, kernel: str):
    """Eager and compiled runs of the same steps, one after the other; prints the comparison."""
    eager = measure(work / "eager", model, seq_len, steps, kernel)
    compiled = measure(work / "compiled", model, seq_len, steps, kernel, "--model.compile")
    saving = eager["step_seconds"] - compiled["step_seconds"]
    seconds = compiled["compile_seconds"]
    result = {
        "shape": shape,
        "seq_len": seq_len,
        "attn_implementation": kernel,
        "steps": steps,
        "eager_step_seconds": eager["step_seconds"],
        "compiled_step_seconds": compiled["step_seconds"],
        "speedup": eager["step_seconds"] / compiled["step_seconds"],
        "compile_seconds": seconds,
        "compile_graphs": compiled["compile_graphs"],
        "break_even_steps": math.ceil(seconds / saving) if saving > 0 else None,
        "loss_last": [eager["loss_first_last"][1], compiled["loss_first_last"][1]],
    }
    print(
        f"{shape}, seq_len {seq_len}: eager {result['eager_step_seconds']:.3f} s/step, compiled "
        f"{result['compiled_step_seconds']:.3f} s/step ({result['speedup']:.2f}x), compile "
        f"{seconds:.1f} s in {result['compile_graphs']} graphs, break-even after "
        f"{result['break_even_steps']} steps"
    )
    print(json.dumps(result))


def measure(run: Path, model: Path, seq_len: int, steps: int, kernel: str, *extra: str) -> dict:
    """`fnt sft` for `steps` steps in a subprocess; the steady-state numbers of its rows."""
    command = [
        sys.executable, "-m", "fnt", "sft", "--model.name", str(model),
        "--output-dir", str(run), "--max-steps", str(steps), "--seq-len", str(seq_len),
        "--batch-size", "1", "--micro-batch-size", "1", "--model.compute-dtype", "bfloat16",
        "--model.attn-implementation", kernel, "--optim.lr", "1e-5", "--ckpt.save-final", "false",
        *extra,
    ]  # fmt: skip
    # The checkout first, then whatever the caller's path holds (a bare GPU machine's wheels).
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"fnt sft failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    return {
        "seq_len": seq_len,
        "attn_implementation": kernel,
        "steps": len(rows),
        "tokens_per_second": statistics.mean(r["perf/throughput"] for r in steady),
        "mfu": statistics.mean(r["perf/mfu"] for r in steady),
        "step_seconds": statistics.mean(
            r["time/step"] - r.get("time/compile", 0.0) for r in steady
        ),
        "peak_memory_gib": max(r["perf/peak_memory"] for r in rows),
        "loss_first_last": [rows[0]["loss/mean"], rows[-1]["loss/mean"]],
        "compile_seconds": sum(r.get("time/compile", 0.0) for r in rows),
        "compile_graphs": int(sum(r.get("perf/compile_graphs", 0.0) for r in rows)),
    }


if __name__ == "__main__":
    main()
