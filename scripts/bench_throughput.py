"""SFT throughput of `fnt sft` at a real shape: a Qwen3-0.6B-shaped model with random weights,
bfloat16 compute over float32 masters, one packed row of seq_len tokens per step, a varlen
flash-attention kernel when one is installed (else sdpa). Side effects: writes the model and a
run directory under --work, runs `python -m fnt sft` in a subprocess.

    python scripts/bench_throughput.py [--seq-len 8192] [--steps 6] [--work DIR] [--tiny]

`--tiny` shrinks the model (2 layers, hidden 64) and the row (256 tokens) so that the whole
path runs in seconds on a CPU. Prints the steady-state numbers (steps after the first) and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def qwen3_config(tiny: bool):
    from transformers import Qwen3Config

    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
        if tiny
        else dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    )  # fmt: skip
    return Qwen3Config(
        vocab_size=151_936, max_position_embeddings=32_768, tie_word_embeddings=True, **shape
    )


def write_model(out: Path, tiny: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from fnt.model.tiny_model import byte_level_tokenizer

    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen3_config(tiny), dtype=torch.float32)
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
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model and row")
    args = parser.parse_args()
    seq_len = 256 if args.tiny else args.seq_len
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-throughput-"))
    model = write_model(work / ("qwen3-tiny" if args.tiny else "qwen3-0.6b-shape"), args.tiny)
    kernel = attention_kernel()
    run = work / "run"
    command = [
        sys.executable, "-m", "fnt", "sft", "--model.name", str(model),
        "--output-dir", str(run), "--max-steps", str(args.steps), "--seq-len", str(seq_len),
        "--batch-size", "1", "--micro-batch-size", "1", "--model.compute-dtype", "bfloat16",
        "--model.attn-implementation", kernel, "--optim.lr", "1e-5", "--ckpt.save-final", "false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"fnt sft failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    result = {
        "seq_len": seq_len,
        "attn_implementation": kernel,
        "steps": len(rows),
        "tokens_per_second": statistics.mean(r["perf/throughput"] for r in steady),
        "mfu": statistics.mean(r["perf/mfu"] for r in steady),
        "step_seconds": statistics.mean(r["time/step"] for r in steady),
        "peak_memory_gib": max(r["perf/peak_memory"] for r in rows),
        "loss_first_last": [rows[0]["loss/mean"], rows[-1]["loss/mean"]],
    }
    print(
        f"seq_len {seq_len}, {kernel}: {result['tokens_per_second']:.0f} tokens/s, "
        f"MFU {result['mfu']:.3f}, {result['step_seconds']:.2f} s/step, "
        f"peak {result['peak_memory_gib']:.2f} GiB"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
