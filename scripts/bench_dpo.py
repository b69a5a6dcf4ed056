"""DPO throughput of `fnt dpo` against TRL's DPOTrainer on the same tiny model and pairs, in one
run. Side effects: writes a model, the pairs and both runs under --work, and runs each trainer
in a subprocess.

    python scripts/bench_dpo.py [--steps 12] [--warmup 3] [--trl-python PYTHON] [--work DIR]
        [--shape tiny|0.6b] [--model DIR]

TRL is never a dependency of fnt: it runs under another virtualenv's interpreter (--trl-python,
default $FNT_TRL_PYTHON, else .venv-trl/bin/python), which needs `trl` and can share fnt's torch
and transformers, e.g. `python -m venv .venv-trl`, a .pth file naming .venv's site-packages, and
`.venv-trl/bin/pip install trl`; failing those, this interpreter when it can import trl (a GPU
machine's, with the wheels scripts/gpu_check.sh installs). Without any, fnt alone is measured
and the JSON says why.

`--shape 0.6b` is the GPU size (scripts/gpu_check.sh): a Qwen3-0.6B-shaped model with random
weights (scripts/bench_throughput.py's write_model; --model names one written already),
bfloat16 compute over float32 weights on both sides (fnt's model.compute_dtype, TRL's bf16),
longer pairs (a 100-200 character text: about 300 tokens a side), rows of 4096 tokens, no
gradient checkpointing on TRL's side (its default is on; fnt does not recompute), each side
timed with the device synchronized, and no one-thread limit. `--shape tiny` (the default) is the
CPU comparison below, as it was measured (TRL's gradient checkpointing left at its default).

Both sides do the same work: the demo's model shape (hidden 128, 2 layers) in float32, full
parameters with a frozen copy as the reference, the sigmoid loss (beta 0.1), AdamW at a
constant lr, grad-norm clipping at 1, one process with one thread, and the same pairs in chat
format (rendered with the same template), the same number of pairs per step (TRL's batch size
is the mean number of pairs fnt packed into a step). fnt packs both sides of every pair into
rows of --seq-len tokens as isolated documents and runs them in one forward; TRL concatenates
chosen and rejected into one padded batch. Steady state is the steps after --warmup; pairs/s is
pairs over the summed step times, tokens/s the pairs' own tokens (prompt and response of both
sides, no padding; fnt's count, the same rendering for TRL) over the same time. Last line: one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = "--hidden-size 128 --intermediate-size 256 --layers 2 --heads 4 --kv-heads 2".split()
LR, BETA = 1e-4, 0.1

TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

args = json.loads(sys.argv[1])
cuda = not args.get("cpu", True) and torch.cuda.is_available()
if not cuda:
    torch.set_num_threads(1)
torch.manual_seed(0)
records = [json.loads(line) for line in open(args["pairs"])]
def chat(r):
    return {"prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}]}
dataset = Dataset.from_list([chat(r) for r in records])
tokenizer = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)

class Timer(TrainerCallback):
    def __init__(self):
        self.times, self.started = [], None
    def on_step_begin(self, *a, **k):
        if cuda:
            torch.cuda.synchronize()
        self.started = time.perf_counter()
    def on_step_end(self, *a, **k):
        if cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.started)

timer = Timer()
extra = {} if args.get("gradient_checkpointing") is None else {
    "gradient_checkpointing": args["gradient_checkpointing"]}
config = DPOConfig(
    output_dir=args["out"], per_device_train_batch_size=args["batch"], max_steps=args["steps"],
    learning_rate=args["lr"], lr_scheduler_type="constant", warmup_steps=0, beta=args["beta"],
    loss_type="sigmoid", max_grad_norm=1.0, max_length=args["seq_len"], logging_steps=args["steps"],
    save_strategy="no", report_to="none", use_cpu=not cuda, bf16=args.get("bf16", False),
    dataloader_num_workers=0, seed=0, precompute_ref_log_probs=False, **extra,
)
trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                     callbacks=[timer])
trainer.train()
print(json.dumps({"step_times": timer.times}))
"""


def write_pairs(path: Path, count: int, seed: int = 0, lengths: tuple[int, int] = (4, 10)) -> Path:
    """Reverse-text pairs: the correct reversal preferred to one with a letter changed; the
    texts have `lengths` (a range) characters."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*lengths)))
        answer = text[::-1]
        i = rng.randrange(len(answer))
        wrong = answer[:i] + rng.choice([c for c in string.ascii_lowercase if c != answer[i]])
        record = {
            "prompt": f"reverse: {text}",
            "chosen": answer,
            "rejected": wrong + answer[i + 1 :],
        }
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def environment(one_thread: bool = True) -> dict[str, str]:
    """The sides' environment: the checkout first on the path (then what PYTHONPATH had, such
    as the GPU check's installed wheels) and, on CPU, one OpenMP thread."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return {**env, "OMP_NUM_THREADS": "1"} if one_thread else env


def run_fnt(model: Path, pairs: Path, out: Path, args) -> dict:
    sources = json.dumps([{"path": str(pairs)}])
    command = [sys.executable, "-m", "fnt", "dpo", "--model.name", str(model)]
    command += ["--output-dir", str(out), "--data.kind", "sources", "--data.sources", sources]
    command += ["--seq-len", str(args.seq_len), "--batch-size", str(args.rows)]
    command += ["--micro-batch-size", str(args.rows), "--max-steps", str(args.steps)]
    command += ["--optim.lr", str(LR), "--dpo.beta", str(BETA), "--ckpt.save-final", "false"]
    if args.gpu:
        command += ["--model.compute-dtype", "bfloat16"]
    else:
        command += ["--runtime.num-threads", "1"]
    subprocess.run(
        command, cwd=REPO, env=environment(not args.gpu), check=True, stdout=subprocess.DEVNULL
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup :]
    seconds = sum(r["time/step"] for r in steady)
    pairs = sum(r["data/num_samples"] for r in steady)
    tokens = sum(r["data/num_tokens"] for r in steady)
    return {
        "pairs_per_step": statistics.mean(r["data/num_samples"] for r in rows),
        "tokens_per_pair": tokens / pairs,
        "pairs_per_s": pairs / seconds,
        "tokens_per_s": tokens / seconds,
        "step_s": statistics.median(r["time/step"] for r in steady),
    }


def run_trl(python: str, model: Path, pairs: Path, out: Path, batch: int, args) -> dict:
    script = out.parent / "trl_dpo.py"
    script.write_text(TRL_SCRIPT)
    spec = {"pairs": str(pairs), "model": str(model), "out": str(out), "batch": batch}
    spec.update(steps=args.steps, lr=LR, beta=BETA, seq_len=args.seq_len)
    if args.gpu:
        spec.update(cpu=False, bf16=True, gradient_checkpointing=False)
    # This interpreter keeps PYTHONPATH (where the GPU check installed trl); another venv's not.
    env = environment(not args.gpu)
    if python != sys.executable:
        env["PYTHONPATH"] = ""
    proc = subprocess.run(
        [python, str(script), json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    times = json.loads(proc.stdout.strip().splitlines()[-1])["step_times"][args.warmup :]
    return {"pairs_per_s": batch * len(times) / sum(times), "step_s": statistics.median(times)}


def trl_python(given: str | None) -> tuple[str | None, str | None]:
    """The interpreter with trl, or None and why not."""
    python = given or os.environ.get("FNT_TRL_PYTHON") or str(REPO / ".venv-trl/bin/python")
    if not given and not os.environ.get("FNT_TRL_PYTHON") and not Path(python).is_file():
        here = subprocess.run(
            [sys.executable, "-c", "import trl"], env=environment(), capture_output=True
        )
        if here.returncode == 0:
            return sys.executable, None
    if not Path(python).is_file():
        return None, f"no interpreter at {python} (set --trl-python or FNT_TRL_PYTHON)"
    check = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True)
    if check.returncode != 0:
        return None, f"{python} cannot import trl: {check.stderr.strip().splitlines()[-1]}"
    return python, None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("tiny", "0.6b"), default="tiny", help="0.6b: GPU size")
    p.add_argument("--model", type=Path, help="a model written already (else one is written)")
    p.add_argument("--steps", type=int, help="12 (0.6b: 8)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    p.add_argument("--rows", type=int, help="fnt: rows of seq_len per step (8; 0.6b: 4)")
    p.add_argument("--seq-len", type=int, help="256 (0.6b: 4096)")
    p.add_argument("--pairs", type=int, help="1024 (0.6b: 512)")
    p.add_argument("--trl-python", help="interpreter of a virtualenv with trl")
    p.add_argument("--work", type=Path, help="where the model and runs go (default: a temp dir)")
    args = p.parse_args(argv)
    args.gpu = args.shape == "0.6b"
    defaults = {"steps": (12, 8), "rows": (8, 4), "seq_len": (256, 4096), "pairs": (1024, 512)}
    for key, values in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.gpu])
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or work / "model"
    if args.gpu and args.model is None:
        sys.path.insert(0, str(REPO))
        from scripts.bench_throughput import write_model

        model = write_model(work / "qwen3-0.6b", "0.6b")
    if not (model / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "fnt", "make-tiny-model", "--out", str(model), *TINY_MODEL],
            cwd=REPO,
            env=environment(),
            check=True,
            stdout=subprocess.DEVNULL,
        )
    pairs = write_pairs(
        work / "pairs.jsonl", args.pairs, lengths=(100, 200) if args.gpu else (4, 10)
    )
    for stale in ("fnt", "trl"):
        subprocess.run(["rm", "-rf", str(work / stale)], check=True)
    fnt = run_fnt(model, pairs, work / "fnt", args)
    batch = max(1, round(fnt["pairs_per_step"]))
    print(
        f"fnt dpo: {fnt['pairs_per_s']:.1f} pairs/s, {fnt['tokens_per_s']:.0f} tokens/s, "
        f"{fnt['pairs_per_step']:.1f} pairs/step, {fnt['step_s']:.3f} s/step"
    )
    result = {"bench": "dpo", "shape": args.shape, "model": str(model), "steps": args.steps}
    result |= {"warmup": args.warmup, "seq_len": args.seq_len, "pairs_per_step": batch}
    result["fnt_pairs_per_s"] = round(fnt["pairs_per_s"], 2)
    result["fnt_tokens_per_s"] = round(fnt["tokens_per_s"], 1)
    python, why = trl_python(args.trl_python)
    if python is None:
        result["trl"] = f"not measured: {why}"
    else:
        trl = run_trl(python, model, pairs, work / "trl", batch, args)
        trl_tokens = trl["pairs_per_s"] * fnt["tokens_per_pair"]
        print(
            f"TRL DPOTrainer: {trl['pairs_per_s']:.1f} pairs/s, {trl_tokens:.0f} tokens/s, "
            f"{batch} pairs/step, {trl['step_s']:.3f} s/step"
        )
        result["trl_pairs_per_s"] = round(trl["pairs_per_s"], 2)
        result["trl_tokens_per_s"] = round(trl_tokens, 1)
        result["fnt_over_trl"] = round(fnt["pairs_per_s"] / trl["pairs_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
