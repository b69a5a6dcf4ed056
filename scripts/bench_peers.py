"""One SFT step of `fnt sft` against its peers, a bare PyTorch loop and TRL's SFTTrainer, on the
same model and the same token rows, each side in its own subprocess (so memory does not carry
over from one side to the next). Side effects: writes the model (a Qwen3-0.6B shape with random
weights, scripts/bench_throughput.py's write_model), the rows and the runs under --work.

    python scripts/bench_peers.py [--seq-len 8192] [--steps 8] [--warmup 2] [--work DIR]
        [--tiny] [--peak-flops F] [--side-timeout S] [--sides fnt,trl,bare] [--fnt-args ARGS]

Every step of every side trains one row of exactly seq_len tokens: one document of seq_len
random byte-level ids (letters, digits and spaces, one token each with the model's byte-level
tokenizer), row i at step i on every side. fnt reads them as one-message chats rendered by a
template that prints only the content, trained on every token (data.loss_mask = ["user"], no
shuffling); the bare loop and TRL get the same ids already tokenized.

    fnt   `python -m fnt sft`, batch 1, micro-batch 1, compute in bfloat16 over float32 weights,
          lr 1e-5 constant, grad clip 1.0. Neither model.attn_implementation nor model.compile is
          passed: fnt's defaults decide, and the JSON reports what its config.json recorded
          (--fnt-args adds arguments). Where fnt fails with them, it runs once more with sdpa
          and no compile (FALLBACK_ARGS, in place of --fnt-args), and "fnt_failed" in the JSON
          says what failed.
    bare  the HF model's forward with labels under torch.autocast(bfloat16) over float32
          weights, sdpa, backward, clip_grad_norm_(1.0), torch.optim.AdamW(fused=True), lr 1e-5,
          no weight decay (as fnt and TRL).
    trl   SFTTrainer(bf16=True, optim="adamw_torch_fused", per_device_train_batch_size 1,
          gradient_accumulation_steps 1, max_length seq_len, no packing, lr 1e-5 constant,
          max_grad_norm 1.0, logging and saving off, report_to none, gradient_checkpointing off
          (TRL's default is on; fnt and the bare loop do not recompute), sdpa), timed by a
          TrainerCallback from on_step_begin to on_step_end, synchronized.

Seconds per step are the mean over the steps after --warmup, each step synchronized (fnt's
time/step, less its time/compile; torch.cuda.synchronize around the bare and TRL steps).
tokens/s is seq_len over that. Peak memory is torch.cuda.max_memory_allocated (fnt's
perf/peak_memory; on CPU the process's max resident set). MFU, the same formula for all three
(fnt.obs.metrics.flops_per_token, fnt's perf/mfu): tokens/s x (6 N + 6 L H seq_len) / peak,
N the model's parameters (tied embeddings once), L its layers, H its hidden size (causal
attention: 12 L H seq_len halved); peak the device's dense bf16 FLOP/s from a small table keyed by
torch.cuda.get_device_name() (H200, H100: 989e12; A100: 312e12), else --peak-flops (else no MFU).

`--tiny` is the CPU check of the same code path: a tiny Qwen3 shape (2 layers, hidden 64),
seq_len 256, 3 steps, float32 compute where no CUDA device is present. A side that cannot run
(TRL not importable, a failure, a timeout) gets a reason string instead of numbers. A JSON line
is printed after each side (the results so far, "complete": false); the last line is the whole
JSON object, with the ratios fnt/trl and fnt/bare of tokens/s. The exit status is 1 when a side
failed or timed out (fnt with the settings asked for included), after that line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_throughput import qwen3_config, write_model  # noqa: E402

LR, MAX_NORM = 1e-5, 1.0
SIDES = ("fnt", "trl", "bare")
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 peak FLOP/s by a substring of torch.cuda.get_device_name() (SXM parts)."""
CONTENT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""fnt's chat template for the rows: the message's text and nothing else (no special tokens)."""
ALPHABET = string.ascii_letters + string.digits + " "
FALLBACK_ARGS = ["--model.attn-implementation", "sdpa", "--model.compile", "false"]
"""The fnt side's settings where it fails with those asked for: torch's sdpa, no compile."""


def environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}


# The rows ------------------------------------------------------------------------------------


def write_rows(work: Path, model: Path, seq_len: int, count: int) -> tuple[Path, Path]:
    """`count` rows of seq_len random characters: a JSONL of one-message chats for fnt and a
    JSON of their token ids for the others (checked: exactly seq_len ids each)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seq_len)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(seq_len)) for _ in range(count)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = {len(row) for row in ids}
    if lengths != {seq_len}:
        raise SystemExit(f"the rows tokenize to {sorted(lengths)} ids, not {seq_len}")
    chats = work / f"rows-{seq_len}.jsonl"
    chats.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts)
    )
    token_ids = work / f"rows-{seq_len}.json"
    token_ids.write_text(json.dumps(ids))
    return chats, token_ids


# The sides, each in a subprocess ---------------------------------------------------------------


def fnt_args(spec: dict) -> list[str]:
    """The `fnt sft` arguments of the fnt side (scripts/profile_step.py runs the same)."""
    sources = json.dumps([{"path": spec["chats"]}])
    return [
        "--model.name", spec["model"], "--output-dir", spec["out"],
        "--max-steps", str(spec["steps"]), "--seq-len", str(spec["seq_len"]),
        "--batch-size", "1", "--micro-batch-size", "1", "--model.compute-dtype", spec["dtype"],
        "--optim.lr", str(LR), "--optim.max-norm", str(MAX_NORM), "--ckpt.save-final", "false",
        "--data.kind", "sources", "--data.sources", sources, "--data.shuffle", "false",
        "--data.chat-template", CONTENT_TEMPLATE, "--data.loss-mask", '["user"]',
    ]  # fmt: skip


def run_fnt(spec: dict, timeout: float | None) -> dict:
    """`fnt sft` on the rows (with spec["fnt_args"] after the others); its steady-state numbers
    and the settings its defaults chose."""
    run = Path(spec["out"])
    subprocess.run(["rm", "-rf", str(run)], check=True)
    command = [sys.executable, "-m", "fnt", "sft", *fnt_args(spec), *spec["fnt_args"]]
    done = subprocess.run(
        command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout
    )
    (run.parent / spec.get("log", "fnt.log")).write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"fnt sft exited {done.returncode}: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run / "config.json").read_text())
    tokens = {r["data/num_tokens"] for r in rows if "data/num_tokens" in r}
    return {
        "step_times": [r["time/step"] - r.get("time/compile", 0.0) for r in rows],
        "peak_memory_gib": max(r["perf/peak_memory"] for r in rows),
        "loss_first_last": [rows[0]["loss/mean"], rows[-1]["loss/mean"]],
        "loss_mean": statistics.mean(r["loss/mean"] for r in rows),
        "attn_implementation": config["model"]["attn_implementation"],
        "compile": config["model"]["compile"],
        "compile_seconds": sum(r.get("time/compile", 0.0) for r in rows),
        "own_mfu": statistics.mean(r["perf/mfu"] for r in rows[spec["warmup"] :] or rows),
        "tokens_per_step": sorted(tokens),
    }


def measure_fnt(spec: dict, timeout: float | None, result: dict) -> dict:
    """`run_fnt`; where fnt fails with the settings asked for (its defaults, or --fnt-args), once
    more with FALLBACK_ARGS, the failure kept in result["fnt_failed"]. A GPU machine is lent for
    one try: a fault in a kernel that has not run there yet still leaves fnt's numbers."""
    try:
        return run_fnt(spec, timeout)
    except RuntimeError as e:
        if spec["fnt_args"] == FALLBACK_ARGS:
            raise
        asked = " ".join(spec["fnt_args"]) or "the defaults"
        result["fnt_failed"] = f"with {asked}: {str(e)[-1500:]}"
        print(f"fnt failed with {asked}; measuring it with {' '.join(FALLBACK_ARGS)}", flush=True)
        return run_fnt({**spec, "fnt_args": FALLBACK_ARGS, "log": "fnt-fallback.log"}, timeout)


def run_worker(side: str, spec: dict, timeout: float | None) -> dict:
    """This script's --worker mode for the bare loop or TRL, in a subprocess."""
    command = [sys.executable, __file__, "--worker", side, "--spec", json.dumps(spec)]
    done = subprocess.run(
        command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout
    )
    (Path(spec["out"]).parent / f"{side}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{side} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(side: str, spec: dict) -> None:
    """The bare loop or TRL's SFTTrainer on the token rows; prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    from fnt.obs.metrics import peak_memory_gib

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = spec["dtype"] == "bfloat16"
    rows = json.loads(Path(spec["token_ids"]).read_text())[: spec["steps"]]
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times: list[float] = []
    losses: list[float] = []
    if side == "bare":
        model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        for ids in rows:
            sync()
            started = time.perf_counter()
            x = torch.tensor([ids], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - started)
            losses.append(loss.detach())
        losses = [float(v) for v in losses]
        losses = [losses[0], losses[-1], statistics.mean(losses)]
    else:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import SFTConfig, SFTTrainer

        class Timer(TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                sync()
                self.started = time.perf_counter()

            def on_step_end(self, *args, **kwargs):
                sync()
                times.append(time.perf_counter() - self.started)

        config = SFTConfig(
            output_dir=spec["out"], per_device_train_batch_size=1, gradient_accumulation_steps=1,
            max_steps=len(rows), learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=MAX_NORM, optim="adamw_torch_fused", bf16=bf16,
            use_cpu=not cuda, max_length=spec["seq_len"], packing=False,
            gradient_checkpointing=False, logging_strategy="no", save_strategy="no",
            report_to="none", dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_dict({"input_ids": rows}),
            processing_class=AutoTokenizer.from_pretrained(spec["model"]),
            callbacks=[Timer()],
        )
        losses = [trainer.train().training_loss]  # the mean over the steps
    print(
        json.dumps(
            {
                "step_times": times,
                "peak_memory_gib": peak_memory_gib(device),
                "loss_first_last": losses[:2] if side == "bare" else None,
                "loss_mean": losses[-1],
                "device": torch.cuda.get_device_name() if cuda else "cpu",
            }
        )
    )


# The comparison ------------------------------------------------------------------------------


def model_size(model: Path) -> tuple[int, int, int]:
    """(parameters, layers, hidden size) of the model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in built.parameters()), config.num_hidden_layers, config.hidden_size


def device_peak(given: float | None) -> tuple[str, float | None]:
    """The device's name and its peak bf16 FLOP/s (the table, else --peak-flops, else None)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", given
    name = torch.cuda.get_device_name()
    return name, next((v for k, v in PEAK_FLOPS.items() if k in name), given)


def trl_missing() -> str | None:
    check = subprocess.run(
        [sys.executable, "-c", "import trl"], env=environment(), capture_output=True, text=True
    )
    if check.returncode == 0:
        return None
    lines = check.stderr.strip().splitlines()
    return f"not measured: {sys.executable} cannot import trl ({lines[-1] if lines else ''})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=None, help="8192 (--tiny: 256)")
    parser.add_argument("--steps", type=int, default=None, help="steps per side (8; --tiny: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model and row")
    parser.add_argument("--peak-flops", type=float, default=None, help="for an unknown device")
    parser.add_argument("--side-timeout", type=float, default=None, help="seconds per side")
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides, in this order")
    parser.add_argument(
        "--fnt-args", default="", help="more `fnt sft` arguments, e.g. '--model.compile true'"
    )
    parser.add_argument("--worker", choices=("bare", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return

    import torch

    shape = "tiny" if args.tiny else "0.6b"
    seq_len = args.seq_len or (256 if args.tiny else 8192)
    steps = args.steps or (3 if args.tiny else 8)
    warmup = min(args.warmup, steps - 1)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / f"qwen3-{shape}", shape)
    chats, token_ids = write_rows(work, model, seq_len, steps)
    params, layers, hidden = model_size(model)
    assert qwen3_config(shape).num_hidden_layers == layers
    # fnt's formula (fnt.obs.metrics.flops_per_token): 6 N + 6 L H seq_len per token.
    flops_per_token = 6.0 * params + 6.0 * layers * hidden * seq_len
    result: dict = {
        "bench": "peers", "shape": shape, "seq_len": seq_len, "steps": steps, "warmup": warmup,
        "dtype": dtype, "params": params, "flops_per_token": flops_per_token,
        "mfu_formula": "tokens/s * (6*params + 6*layers*hidden*seq_len) / peak_flops",
    }  # fmt: skip
    for side in args.sides.split(","):
        run_dir = work / f"seq{seq_len}" / side
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        spec = {"model": str(model), "out": str(run_dir), "seq_len": seq_len, "steps": steps}
        spec |= {"warmup": warmup, "dtype": dtype, "chats": str(chats), "token_ids": str(token_ids)}
        spec["fnt_args"] = shlex.split(args.fnt_args)
        why = trl_missing() if side == "trl" else None
        started = time.perf_counter()
        try:
            if why is None:
                measured = (
                    measure_fnt(spec, args.side_timeout, result)
                    if side == "fnt"
                    else run_worker(side, spec, args.side_timeout)
                )
        except subprocess.TimeoutExpired:
            why = f"not measured: timed out after {args.side_timeout:.0f} s"
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            why = f"failed: {str(e)[-1500:]}"
        if why is not None:
            result[side] = why
        else:
            times = measured.pop("step_times")[warmup:]
            if len(times) == 0:
                result[side] = "failed: no steady-state step was timed"
            else:
                step_s = statistics.mean(times)
                measured |= {"step_s": step_s, "tokens_per_s": seq_len / step_s}
                measured["wall_s"] = time.perf_counter() - started
                result[side] = measured
        print(json.dumps({**result, "complete": False}), flush=True)

    device, peak_flops = device_peak(args.peak_flops)
    result |= {"device": device, "peak_flops": peak_flops}
    for side in SIDES:
        if isinstance(result.get(side), dict):
            rate = result[side]["tokens_per_s"]
            result[side]["mfu"] = rate * flops_per_token / peak_flops if peak_flops else None
    for other in ("trl", "bare"):
        if isinstance(result.get("fnt"), dict) and isinstance(result.get(other), dict):
            ratio = result["fnt"]["tokens_per_s"] / result[other]["tokens_per_s"]
            result[f"fnt_over_{other}"] = round(ratio, 3)
    print(f"{'side':5} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for side in SIDES:
        row = result.get(side)
        if isinstance(row, dict):
            mfu = f"{row['mfu']:.3f}" if row["mfu"] is not None else "-"
            print(
                f"{side:5} {row['step_s']:8.3f} {row['tokens_per_s']:10.0f} {mfu:>6} "
                f"{row['peak_memory_gib']:9.2f}"
            )
        elif row is not None:
            print(f"{side:5} {row}")
    if isinstance(result.get("fnt"), dict):
        print(
            f"fnt chose attn_implementation={result['fnt']['attn_implementation']}, "
            f"compile={result['fnt']['compile']}; tokens/s fnt/trl {result.get('fnt_over_trl')}, "
            f"fnt/bare {result.get('fnt_over_bare')}"
        )
    print(json.dumps({**result, "complete": True}))
    if any_side_failed(result):  # the GPU check's summary shows the part's exit status
        sys.exit(1)


def any_side_failed(result: dict) -> bool:
    """Whether fnt failed with the settings asked for, or a side failed or timed out (a side
    that could not be tried, TRL not importable, is no failure)."""
    reasons = [r for r in (result.get(side) for side in SIDES) if isinstance(r, str)]
    return "fnt_failed" in result or any(
        r.startswith("failed") or "timed out" in r for r in reasons
    )


if __name__ == "__main__":
    main()
