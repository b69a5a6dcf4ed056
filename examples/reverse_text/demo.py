"""The reverse-text demo: tiny model -> SFT -> RL, with held-out evals in between.
Side effects: writes under --runs and runs the scripts in subprocesses.

Its last line is one JSON object: {"sft_before": ..., "sft_after": ..., "rl_after": ...}, the
mean held-out similarity (greedy decoding, the same 200 prompts) of the base model, the SFT
result and the RL result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The model learns fastest per second on CPU at this size (see sft.toml).
TINY_MODEL = "--hidden-size 128 --intermediate-size 256 --layers 2 --heads 4 --kv-heads 2".split()


def script_env() -> dict[str, str]:
    """The environment of the scripts: one OpenMP thread unless OMP_NUM_THREADS says otherwise.

    The trainer takes runtime.num_threads from the configs; this is for the other scripts. The
    models are tiny, and on a 2-core machine shared with other processes two threads stall each
    other (the eval took 75 s instead of 8 s).
    """
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run(*args: str) -> None:
    """Run a repository script with this interpreter; its output streams to the console."""
    subprocess.run([sys.executable, *args], cwd=REPO, env=script_env(), check=True)


def evaluate(model: Path, data: Path) -> float:
    """Mean held-out similarity of `model`, as eval.py's last line reports it."""
    args = [str(HERE / "eval.py"), "--model", str(model), "--data", str(data / "heldout.jsonl")]
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    print(proc.stdout, end="", flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["similarity"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runs", type=Path, default=REPO / "runs", help="where models, data and runs go"
    )
    p.add_argument("--skip-rl", action="store_true", help="stop after SFT")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights, the data and the SFT and RL runs",
    )
    args = p.parse_args(argv)
    runs = args.runs.resolve()
    model, data = runs / "reverse-model", runs / "reverse-data"
    sft_dir, sft_hf = runs / "reverse-sft", runs / "reverse-sft-hf"
    rl_dir, rl_hf = runs / "reverse-rl", runs / "reverse-rl-hf"
    for stale in (sft_dir, sft_hf, rl_dir, rl_hf):  # a rerun starts over
        shutil.rmtree(stale, ignore_errors=True)
    started = time.time()
    seconds: dict[str, float] = {}  # wall time of each stage: its run, export and eval

    seed = ("--seed", str(args.seed))
    run("scripts/make_tiny_model.py", "--out", str(model), *TINY_MODEL, *seed)
    run(str(HERE / "make_data.py"), "--out", str(data), *seed)
    result = {"sft_before": evaluate(model, data)}
    seconds["setup"] = time.time() - started

    sources = json.dumps([{"path": str(data / "sft.jsonl")}])
    sft_args = ["--model.name", str(model), "--output-dir", str(sft_dir), "--data.sources", sources]
    run("scripts/sft.py", "--config", str(HERE / "sft.toml"), *sft_args, *seed)
    sft_steps = json.loads((sft_dir / "config.json").read_text())["max_steps"]
    checkpoint = sft_dir / "checkpoints" / f"step_{sft_steps}"
    run("scripts/export_hf.py", "--checkpoint", str(checkpoint), "--out", str(sft_hf))
    result["sft_after"] = evaluate(sft_hf, data)
    seconds["sft"] = time.time() - started - sum(seconds.values())

    if not args.skip_rl:
        rl_args = ["--model.name", str(sft_hf), "--output-dir", str(rl_dir)]
        prompts = ["--rollout.prompts", str(data / "rl.jsonl")]
        run("scripts/rl.py", "--config", str(HERE / "rl.toml"), *rl_args, *prompts, *seed)
        rl_steps = json.loads((rl_dir / "config.json").read_text())["max_steps"]
        checkpoint = rl_dir / "checkpoints" / f"step_{rl_steps}"
        run("scripts/export_hf.py", "--checkpoint", str(checkpoint), "--out", str(rl_hf))
        result["rl_after"] = evaluate(rl_hf, data)
        seconds["rl"] = time.time() - started - sum(seconds.values())

    print(f"demo took {time.time() - started:.0f} s", flush=True)
    # Wall seconds per stage (setup: model, data, base eval; sft and rl: run, export, eval).
    print("stage seconds: " + json.dumps({k: round(v, 1) for k, v in seconds.items()}), flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
