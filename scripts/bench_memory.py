"""Peak memory and step time of fnt's SFT and RL steps against a bare chunked-loss loop, and the
per-rank peak of a ~400M-parameter model at 1 and 2 ranks. Side effects: writes random-weight
models into --work, runs every case in a fresh process (so each peak is its own).

    python scripts/bench_memory.py [--seq-lens 1024,2048,4096] [--work DIR] [--skip-ranks]
    python scripts/bench_memory.py --lora [--work DIR]

Cases, each one optimizer step after one warm-up step, at each seq_len (one packed row):
- fnt_sft: init_state + sft_step on a Qwen3-shaped model with Qwen3's vocabulary (151,936
  tokens, hidden 256, 2 layers, tied embeddings, float32) and synthetic rows;
- fnt_rl: init_state + rl_step on the same model, the second half of the row being the
  completion (loss tokens), with inference logprobs;
- bare: the reference, a plain loop over the same model: hidden states from `model.model`, the
  loss from the head in 1024-token chunks, each chunk checkpointed, then AdamW.
Peak memory is the process's maximum resident set (RSS) on CPU, torch.cuda.max_memory_allocated
on CUDA. Then `ranks`: load + one SFT step of a ~400M-parameter Llama-shaped model under
torchrun at 1 and 2 ranks, the peak RSS of each rank. The last line is one JSON object.

`--lora` measures only LoRA against full fine-tuning on the ~400M model: rank 16 on every linear
layer, one 256-token row per rank, at 1 and 2 ranks; per-rank peak, the mean time of two steps
after a warm-up one, and the checkpoint written after them (the lower of two runs each), with
the ratios LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
CHUNK = 1024


def peak_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def seconds_since(started: float, device) -> float:
    """Wall time since `started`, after the device has finished its queued work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def write_model(out: Path, *, big: bool) -> Path:
    """A random-weight model directory with the tiny byte-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from fnt.model.tiny_model import byte_level_tokenizer

    if (out / "config.json").is_file():
        return out
    tok = byte_level_tokenizer()
    if big:  # ~400M parameters, 1.6 GB in float32
        config = LlamaConfig(
            vocab_size=32_000,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    else:
        config = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=16_384,
            tie_word_embeddings=True,
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def synthetic_sft_batch(seq_len: int):
    from fnt.batch import DataPosition, SftBatch
    from fnt.data.synthetic import synthetic_rows

    rows, docs = synthetic_rows(seed=0, step=1, num_rows=1, seq_len=seq_len)
    return SftBatch(micro_batches=(rows,), num_samples=sum(docs), data_after=DataPosition())


def synthetic_rl_batch(seq_len: int):
    """One row: a prompt of half the row, then its completion (the loss tokens)."""
    import torch

    from fnt.batch import DataPosition, PackedRows, RLBatch, RLMicroBatch

    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_len)[None]
    mask = positions >= seq_len // 2
    rows = PackedRows(ids, positions, torch.zeros_like(ids), mask)
    mb = RLMicroBatch(
        rows=rows,
        advantages=torch.where(mask, 1.0, 0.0),
        temperatures=torch.ones(1, seq_len),
        inference_logprobs=torch.where(mask, -5.0, 0.0),
        sample_lengths=((seq_len,),),
    )
    return RLBatch(micro_batches=(mb,), num_samples=1, data_after=DataPosition())


def fnt_case(model_dir: str, seq_len: int, kind: str) -> dict:
    from fnt import Config, ModelConfig, RLConfig, init_state, setup_trainer
    from steps import rl_step, sft_step

    cls, step, batch = (
        (Config, sft_step, synthetic_sft_batch(seq_len))
        if kind == "sft"
        else (RLConfig, rl_step, synthetic_rl_batch(seq_len))
    )
    config = cls(
        model=ModelConfig(name=model_dir),
        seq_len=seq_len,
        batch_size=1,
        micro_batch_size=1,
    )
    state = init_state(config, setup_trainer(config))
    state, _ = step(state, batch)  # warm-up: optimizer state exists from here on
    started = time.perf_counter()
    state, _ = step(state, batch)
    device = state.handles.runtime.device
    return {"seconds": seconds_since(started, device), "peak_gib": peak_gib(device)}


def bare_case(model_dir: str, seq_len: int) -> dict:
    """The reference: the loss from hidden states in checkpointed 1024-token chunks."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = synthetic_sft_batch(seq_len).micro_batches[0].input_ids.to(device)

    def chunk_loss(hidden, targets):
        return F.cross_entropy(model.lm_head(hidden).float(), targets, reduction="sum")

    def step():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        targets = ids[0, 1:]
        loss = sum(
            checkpoint(
                chunk_loss, hidden[i : i + CHUNK], targets[i : i + CHUNK], use_reentrant=False
            )
            for i in range(0, len(targets), CHUNK)
        )
        (loss / len(targets)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    started = time.perf_counter()
    step()
    return {"seconds": seconds_since(started, device), "peak_gib": peak_gib(device)}


def ranks_case(
    model_dir: str, seq_len: int, lora_rank: int = 0, steps: int = 1, out: str = ""
) -> dict:
    """Load + SFT steps under torchrun (model.lora.rank = `lora_rank`, on every linear layer):
    this rank's peak, the mean time of `steps` steps after a warm-up one (with steps > 1), and,
    given an output directory `out`, the size and save time of the checkpoint after them."""
    from fnt import Config, LoraConfig, ModelConfig, init_state, setup_trainer, teardown_trainer
    from fnt.build import save_state_
    from fnt.sources import sft_source
    from steps import sft_step

    world = int(os.environ.get("WORLD_SIZE", 1))
    model = ModelConfig(name=model_dir, lora=LoraConfig(rank=lora_rank))
    config = Config(
        output_dir=out, model=model, seq_len=seq_len, batch_size=world, micro_batch_size=1
    )
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    loaded = peak_gib(runtime.device)
    if steps > 1:
        state, _ = sft_step(state, sft_source(state))
    started = time.perf_counter()
    for _ in range(steps):
        state, _ = sft_step(state, sft_source(state))
    result = {
        "rank": runtime.rank,
        "seconds": seconds_since(started, runtime.device) / steps,
        "loaded_peak_gib": loaded,
        "peak_gib": peak_gib(runtime.device),
    }
    if out:
        started = time.perf_counter()
        ckpt = save_state_(state)
        result["save_seconds"] = time.perf_counter() - started
        result["ckpt_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    teardown_trainer(runtime)
    return result


def lora_vs_full(model_dir: str, seq_len: int, lora_rank: int, work: Path) -> dict:
    """Full fine-tuning and LoRA on the ~400M model at 1 and 2 ranks: per-rank peak, step time
    and checkpoint size of each, and their ratios (LoRA / full). Each is run twice, in the order
    full, LoRA, LoRA, full, and the lower peak and time count: what one run leaves behind (page
    cache, reclaim) adds to the next one's, and noise only ever adds. The checkpoints are
    written under `work` and deleted once measured."""
    results: dict = {"lora_rank": lora_rank, "seq_len": seq_len}
    for nproc in (1, 2):
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for name in ("full", "lora", "lora", "full"):
            out = work / f"run-{name}-{nproc}"
            args = ["--case", "ranks", "--model", model_dir, "--seq-len", str(seq_len)]
            rank = lora_rank if name == "lora" else 0
            args += ["--lora-rank", str(rank), "--steps", "2", "--out", str(out)]
            rows = run_case(args, nproc=nproc)
            shutil.rmtree(out)
            runs[name].append(
                {
                    "peak_gib": max(r["peak_gib"] for r in rows),
                    "step_seconds": max(r["seconds"] for r in rows),
                    "ckpt_mib": rows[0]["ckpt_bytes"] / 2**20,
                    "save_seconds": max(r["save_seconds"] for r in rows),
                }
            )
        row = {
            name: {key: min(run[key] for run in measured) for key in measured[0]}
            for name, measured in runs.items()
        }
        for name in ("full", "lora"):
            print(
                f"~400M model, {nproc} rank(s), {name:>4}: peak {row[name]['peak_gib']:.2f} GiB "
                f"per rank, step {row[name]['step_seconds']:.2f} s, checkpoint "
                f"{row[name]['ckpt_mib']:.1f} MiB"
            )
        for key in ("peak_gib", "step_seconds", "ckpt_mib"):
            row[f"{key}_ratio"] = row["lora"][key] / row["full"][key]
        print(
            f"LoRA / full at {nproc} rank(s): peak {row['peak_gib_ratio']:.2f}x, step "
            f"{row['step_seconds_ratio']:.2f}x, checkpoint {row['ckpt_mib_ratio']:.3f}x"
        )
        results[nproc] = row
    return results


def run_case(args: list[str], nproc: int = 0) -> list[dict]:
    """Run this script's --case in a fresh process (under torchrun when nproc > 0)."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*launcher, __file__, *args], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"case {args} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096")
    parser.add_argument("--work", type=Path, default=None, help="where the models go (reused)")
    parser.add_argument("--skip-ranks", action="store_true", help="skip the ~400M-model case")
    parser.add_argument(
        "--lora",
        action="store_true",
        help="only LoRA (rank 16, every linear layer) against full fine-tuning on the ~400M model",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        cases = {
            "fnt_sft": lambda: fnt_case(args.model, args.seq_len, "sft"),
            "fnt_rl": lambda: fnt_case(args.model, args.seq_len, "rl"),
            "bare": lambda: bare_case(args.model, args.seq_len),
            "ranks": lambda: ranks_case(
                args.model, args.seq_len, args.lora_rank, args.steps, args.out
            ),
        }
        print(json.dumps(cases[args.case]()), flush=True)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-memory-"))
    if args.lora:
        big = str(write_model(work / "llama-400m", big=True))
        print(json.dumps({"lora_vs_full": lora_vs_full(big, 256, 16, work)}))
        return
    small = str(write_model(work / "qwen3-vocab", big=False))
    results: dict = {"vocab": VOCAB, "steps": {}}
    print(f"{'seq_len':>8} {'case':>8} {'peak GiB':>9} {'step s':>8} {'peak / bare':>12}")
    for seq_len in [int(t) for t in args.seq_lens.split(",")]:
        row = {}
        for case in ("bare", "fnt_sft", "fnt_rl"):
            (row[case],) = run_case(["--case", case, "--model", small, "--seq-len", str(seq_len)])
        for case, r in row.items():
            ratio = r["peak_gib"] / row["bare"]["peak_gib"]
            r["peak_vs_bare"] = ratio
            print(
                f"{seq_len:>8} {case:>8} {r['peak_gib']:>9.2f} {r['seconds']:>8.3f} {ratio:>12.2f}"
            )
        results["steps"][seq_len] = row
    lens = sorted(results["steps"])
    if len(lens) > 1:
        growth = (
            results["steps"][lens[-1]]["fnt_sft"]["peak_gib"]
            - results["steps"][lens[0]]["fnt_sft"]["peak_gib"]
        ) / ((lens[-1] - lens[0]) / 1024)
        results["sft_growth_gib_per_1k_tokens"] = growth
        print(f"fnt_sft peak grows {growth:.3f} GiB per extra 1k tokens")
    if not args.skip_ranks:
        big = str(write_model(work / "llama-400m", big=True))
        per_rank = {}
        for nproc in (1, 2):
            rows = run_case(["--case", "ranks", "--model", big, "--seq-len", "256"], nproc=nproc)
            per_rank[nproc] = max(r["peak_gib"] for r in rows)
            loaded = max(r["loaded_peak_gib"] for r in rows)
            print(
                f"~400M model, {nproc} rank(s): peak {per_rank[nproc]:.2f} GiB per rank "
                f"(after loading {loaded:.2f})"
            )
        results["ranks_peak_gib"] = per_rank
        results["two_vs_one_rank"] = per_rank[2] / per_rank[1]
        print(f"2-rank / 1-rank peak per rank: {results['two_vs_one_rank']:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
