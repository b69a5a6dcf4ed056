"""Peak memory and step time of fnt's SFT and RL steps against a bare chunked-loss loop, and the
per-rank peak of a ~400M-parameter model at 1 and 2 ranks. Side effects: writes random-weight
models into --work, runs every case in a fresh process (so each peak is its own).

    python scripts/bench_memory.py [--seq-lens 1024,2048,4096] [--work DIR] [--skip-ranks]

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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

    from fnt.tiny_model import byte_level_tokenizer

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


def ranks_case(model_dir: str, seq_len: int) -> dict:
    """Load + one SFT step under torchrun; this rank's peak."""
    from fnt import Config, ModelConfig, init_state, setup_trainer, teardown_trainer
    from steps import sft_step

    world = int(os.environ.get("WORLD_SIZE", 1))
    config = Config(
        model=ModelConfig(name=model_dir), seq_len=seq_len, batch_size=world, micro_batch_size=1
    )
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    loaded = peak_gib(runtime.device)
    from fnt.sources import sft_source

    started = time.perf_counter()
    state, _ = sft_step(state, sft_source(state))
    result = {
        "rank": runtime.rank,
        "seconds": seconds_since(started, runtime.device),
        "loaded_peak_gib": loaded,
        "peak_gib": peak_gib(runtime.device),
    }
    teardown_trainer(runtime)
    return result


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
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        cases = {
            "fnt_sft": lambda: fnt_case(args.model, args.seq_len, "sft"),
            "fnt_rl": lambda: fnt_case(args.model, args.seq_len, "rl"),
            "bare": lambda: bare_case(args.model, args.seq_len),
            "ranks": lambda: ranks_case(args.model, args.seq_len),
        }
        print(json.dumps(cases[args.case]()), flush=True)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-memory-"))
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
