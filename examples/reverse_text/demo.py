"""The reverse-text demo: tiny model -> SFT -> RL, with held-out evals in between.
Side effects: writes under --runs and runs the scripts in subprocesses.

Its last line is one JSON object: {"sft_before": ..., "sft_after": ..., "rl_after": ...}, the
mean held-out similarity (greedy decoding, the same 200 prompts) of the base model, the SFT
result and the RL result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def run(*args: str) -> str:
    """Run a repository script with this interpreter; its output streams to the console."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
    print(proc.stdout, end="", flush=True)
    return proc.stdout


def evaluate(model: Path, data: Path) -> float:
    out = run(str(HERE / "eval.py"), "--model", str(model), "--data", str(data / "heldout.jsonl"))
    return json.loads(out.strip().splitlines()[-1])["similarity"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=REPO / "runs", help="where models, data and runs go")
    p.add_argument("--skip-rl", action="store_true", help="stop after SFT")
    args = p.parse_args(argv)
    runs = args.runs.resolve()
    model, data = runs / "reverse-model", runs / "reverse-data"
    sft_dir, sft_hf = runs / "reverse-sft", runs / "reverse-sft-hf"
    rl_dir, rl_hf = runs / "reverse-rl", runs / "reverse-rl-hf"
    for stale in (sft_dir, sft_hf, rl_dir, rl_hf):  # a rerun starts over
        shutil.rmtree(stale, ignore_errors=True)
    started = time.time()

    run("scripts/make_tiny_model.py", "--out", str(model), "--hidden-size", "128",
        "--intermediate-size", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2")
    run(str(HERE / "make_data.py"), "--out", str(data))
    result = {"sft_before": evaluate(model, data)}

    run("scripts/sft.py", "--config", str(HERE / "sft.toml"), "--model.name", str(model),
        "--output-dir", str(sft_dir), "--data.sources", json.dumps([{"path": str(data / "sft.jsonl")}]))
    sft_steps = json.loads((sft_dir / "config.json").read_text())["max_steps"]
    run("scripts/export_hf.py", "--checkpoint", str(sft_dir / "checkpoints" / f"step_{sft_steps}"),
        "--out", str(sft_hf))
    result["sft_after"] = evaluate(sft_hf, data)

    if not args.skip_rl:
        run("scripts/rl.py", "--config", str(HERE / "rl.toml"), "--model.name", str(sft_hf),
            "--output-dir", str(rl_dir), "--rollout.prompts", str(data / "rl.jsonl"))
        rl_steps = json.loads((rl_dir / "config.json").read_text())["max_steps"]
        run("scripts/export_hf.py", "--checkpoint", str(rl_dir / "checkpoints" / f"step_{rl_steps}"),
            "--out", str(rl_hf))
        result["rl_after"] = evaluate(rl_hf, data)

    print(f"demo took {time.time() - started:.0f} s", flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
