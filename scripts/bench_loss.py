"""Benchmark the SFT loss's LM head: fnt's chunked path, its full-logits path and a bare loop.

Side effects: starts one subprocess per case (so each peak RSS is that case's own), allocates up
to about 15 GiB at seq_len 4096 in the full-logits case, prints a table and, as its last line,
one JSON object.

Each case is one SFT forward+backward of one row of seq_len tokens, every token a loss token, on
a one-layer Llama with Qwen3's vocabulary (V = 151,936), hidden size 256 and a tied head:

    chunked  fnt.update.accumulate_gradients_ with model.loss_chunk_tokens = 1024 (the default)
    full     the same with loss_chunk_tokens = 0: the model's own head makes all the logits
    bare     the reference: the decoder's hidden states, then cross entropy from them in
             1024-token chunks, each under torch.utils.checkpoint, summed and back-propagated

Peak RSS is the case process's ru_maxrss (model and gradients included; `base` is the RSS before
the first step). Times are the median of --reps steps after one warm-up step. The tiny model of
`fnt make-tiny-model` (V = 260) is then timed at seq_len 256, chunked against full, interleaved
within each repetition so that machine noise hits both alike.

    python scripts/bench_loss.py [--seq-lens 1024 2048 4096] [--reps 3] [--tiny-reps 30]

`--kernels` times model.loss_kernel instead, on the LM head alone at Qwen3-0.6B's shape (hidden
1024, V = 151,936, a float32 weight, bfloat16 autocast where the device has it): one forward and
backward of fnt's chunked head over `--seq-lens` loss tokens, eager and compiled chunks, against
the bare reference (cross entropy in checkpointed chunks); the median of --reps after a warm-up
(the compile's seconds reported apart), the compiled logprobs' largest difference from eager's,
and the JSON line last. `--tiny` shrinks it (hidden 64, V 4096) for a CPU.

    python scripts/bench_loss.py --kernels [--seq-lens 8192] [--reps 10] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fnt.batch import DataPosition, PackedRows, SftBatch, to_device
from fnt.config import ParallelConfig
from fnt.config.parallel import plan_parallel_dims
from fnt.data.synthetic import synthetic_rows
from fnt.distributed.runtime import Runtime
from fnt.model.attention import attention_mask_for
from fnt.model.tiny_model import byte_level_tokenizer, parse_args, tiny_config
from fnt.optim.setup import NO_OFFLOAD
from fnt.update import accumulate_gradients_
from steps.sft import sft_loss

QWEN3_VOCAB = 151_936
CHUNK = 1024
CASES = ("chunked", "full", "bare")
RUNTIME = Runtime(
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    device=torch.device("cpu"),
    distributed=False,
    dims=plan_parallel_dims(ParallelConfig(), 1, 1),
    mesh=None,
    num_threads=torch.get_num_threads(),
    offload=NO_OFFLOAD,
)


def big_vocab_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=QWEN3_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def one_row(seq_len: int, vocab_size: int) -> PackedRows:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (1, seq_len), generator=gen)
    positions = torch.arange(seq_len)[None]
    return PackedRows(input_ids, positions, torch.zeros_like(input_ids), positions > 0)


def fnt_step(model, rows: PackedRows, chunk_tokens: int) -> None:
    batch = SftBatch((rows,), num_samples=1, data_after=DataPosition())
    accumulate_gradients_(model, batch, RUNTIME, sft_loss, chunk_tokens=chunk_tokens)


def _chunk_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def bare_step(model, rows: PackedRows) -> None:
    hidden = model.model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        attention_mask=attention_mask_for(model, rows),
        use_cache=False,
    ).last_hidden_state
    mask = rows.loss_mask[:, 1:]
    selected, targets = hidden[:, :-1][mask], rows.input_ids[:, 1:][mask]
    weight = model.lm_head.weight
    loss = sum(
        checkpoint(
            _chunk_loss,
            selected[i : i + CHUNK],
            weight,
            targets[i : i + CHUNK],
            use_reentrant=False,
        )
        for i in range(0, selected.shape[0], CHUNK)
    )
    (loss / selected.shape[0]).backward()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_case(case: str, seq_len: int, reps: int) -> dict:
    """One case in this process: the median step time and the peak RSS."""
    model = big_vocab_model()
    rows = one_row(seq_len, QWEN3_VOCAB)
    step = {
        "chunked": lambda: fnt_step(model, rows, CHUNK),
        "full": lambda: fnt_step(model, rows, 0),
        "bare": lambda: bare_step(model, rows),
    }[case]
    base = rss_mib()
    times = []
    for _ in range(reps + 1):  # the first is the warm-up
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "case": case,
        "seq_len": seq_len,
        "time_s": statistics.median(times[1:]),
        "peak_rss_mib": peak,
        "base_rss_mib": base,
    }


def tiny_times(reps: int) -> dict:
    """Median step time of the tiny model at seq_len 256, chunked and full, for 4 and 8 rows."""
    tok = byte_level_tokenizer()
    config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, parse_args(["--out", "-"]))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    out = {}
    for num_rows in (4, 8):
        rows, _ = synthetic_rows(seed=0, step=1, num_rows=num_rows, seq_len=256)
        times = {"chunked": [], "full": []}
        for _ in range(reps + 1):
            for case, chunk_tokens in (("chunked", CHUNK), ("full", 0)):
                model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                fnt_step(model, rows, chunk_tokens)
                times[case].append(time.perf_counter() - started)
        medians = {case: statistics.median(t[1:]) for case, t in times.items()}
        out[f"{num_rows}x256"] = {
            **{f"{case}_ms": 1e3 * m for case, m in medians.items()},
            "loss_tokens": int(rows.loss_mask[:, 1:].sum()),
            "chunked_over_full": medians["chunked"] / medians["full"],
        }
    return out


def timed(step, device: torch.device, reps: int) -> tuple[float, float]:
    """(the first call's seconds, the median of `reps` more), the device's queue drained."""
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:])


def kernel_times(seq_len: int, reps: int, tiny: bool) -> dict:
    """model.loss_kernel eager and compiled, and the bare reference, on the head alone."""
    from fnt.model.lm_head import chunked_token_stats, loss_tokens_of

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden_size, vocab = (64, 4096) if tiny else (1024, QWEN3_VOCAB)
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden_size, generator=gen).to(device))
    hidden = torch.randn(1, seq_len, hidden_size, generator=gen).to(device).requires_grad_()
    rows = to_device(one_row(seq_len, vocab), device)
    tokens = loss_tokens_of(rows)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def fnt_head(kernel):
        def step():
            weight.grad = hidden.grad = None
            with autocast:
                stats = chunked_token_stats(hidden, weight, None, tokens, CHUNK, kernel)
            (-stats[0].sum()).backward()
            return stats[0].detach()

        return step

    def bare():
        weight.grad = hidden.grad = None
        with autocast:
            selected = hidden.flatten(0, 1).index_select(0, tokens.index)
            loss = sum(
                checkpoint(
                    _chunk_loss,
                    selected[i : i + CHUNK],
                    weight,
                    tokens.targets[i : i + CHUNK],
                    use_reentrant=False,
                )
                for i in range(0, selected.shape[0], CHUNK)
            )
        loss.backward()

    out = {"seq_len": seq_len, "hidden": hidden_size, "vocab": vocab, "device": device.type}
    for name, step in (("eager", fnt_head("eager")), ("compiled", fnt_head("compiled")),
                       ("bare", bare)):  # fmt: skip
        first, median = timed(step, device, reps)
        out[f"{name}_ms"] = 1e3 * median
        out[f"{name}_first_s"] = first
    difference = (fnt_head("compiled")() - fnt_head("eager")()).abs().max()
    out["compiled_max_logp_diff"] = float(difference)
    out["compiled_over_eager"] = out["compiled_ms"] / out["eager_ms"]
    out["eager_over_bare"] = out["eager_ms"] / out["bare_ms"]
    out["compiled_over_bare"] = out["compiled_ms"] / out["bare_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--tiny-reps", type=int, default=30)
    p.add_argument("--kernels", action="store_true", help="model.loss_kernel on the head alone")
    p.add_argument("--tiny", action="store_true", help="with --kernels: a CPU-sized head")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in a subprocess
    args = p.parse_args()
    if args.kernels:
        results = [kernel_times(n, args.reps or 10, args.tiny) for n in args.seq_lens or [8192]]
        for r in results:
            print(
                f"{r['device']}, {r['seq_len']} loss tokens, V {r['vocab']}: eager "
                f"{r['eager_ms']:.1f} ms, compiled {r['compiled_ms']:.1f} ms (compile "
                f"{r['compiled_first_s']:.1f} s), bare {r['bare_ms']:.1f} ms; compiled/eager "
                f"{r['compiled_over_eager']:.3f}, eager/bare {r['eager_over_bare']:.3f}"
            )
        print(json.dumps({"kernels": results}))
        return
    args.seq_lens = args.seq_lens or [1024, 2048, 4096]
    args.reps = args.reps or 3
    if args.case:
        print(json.dumps(run_case(args.case, args.seq_lens[0], args.reps)))
        return

    results = []
    print(f"{'seq_len':>7} {'case':>8} {'step s':>8} {'peak RSS MiB':>13} {'base MiB':>9}")
    for seq_len in args.seq_lens:
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--seq-lens", str(seq_len)]
            proc = subprocess.run(
                [*command, "--reps", str(args.reps)], capture_output=True, text=True, check=True
            )
            r = json.loads(proc.stdout.splitlines()[-1])
            results.append(r)
            print(
                f"{seq_len:>7} {case:>8} {r['time_s']:>8.3f} {r['peak_rss_mib']:>13.0f}"
                f" {r['base_rss_mib']:>9.0f}"
            )
    by = {(r["seq_len"], r["case"]): r for r in results}
    ratios = {}
    for seq_len in args.seq_lens:
        chunked, bare, full = (by[seq_len, c] for c in ("chunked", "bare", "full"))
        ratios[str(seq_len)] = {
            "time_chunked_over_bare": chunked["time_s"] / bare["time_s"],
            "peak_chunked_over_bare": chunked["peak_rss_mib"] / bare["peak_rss_mib"],
            "time_chunked_over_full": chunked["time_s"] / full["time_s"],
            "peak_chunked_over_full": chunked["peak_rss_mib"] / full["peak_rss_mib"],
        }
        line = ", ".join(f"{key} {value:.3f}" for key, value in ratios[str(seq_len)].items())
        print(f"seq_len {seq_len}: {line}")
    tiny = tiny_times(args.tiny_reps)
    for shape, t in tiny.items():
        print(
            f"tiny model {shape} ({t['loss_tokens']} loss tokens): chunked"
            f" {t['chunked_ms']:.2f} ms, full {t['full_ms']:.2f} ms,"
            f" chunked/full {t['chunked_over_full']:.3f}"
        )
    print(json.dumps({"cases": results, "ratios": ratios, "tiny_seq256": tiny}))


if __name__ == "__main__":
    main()
