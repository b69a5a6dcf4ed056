"""The demo's RL stage under two rollout engines, at several RL seeds, from one SFT model.
Side effects: writes under RUNS/compare/ and runs the scripts (and vLLM servers) in subprocesses.

One RL run's held-out gain varies with its seed by a few hundredths (the draws decide which
answers each step rewards), more than two engines that sample the same distribution differ by.
So an engine is compared by its mean gain over seeds, every engine at the same seeds, from the
same SFT result: that of a finished demo in RUNS (`demo.py --runs RUNS --skip-rl` is enough).
Each run's line is printed as it ends; the last line is one JSON object with the runs and, per
engine, the mean and standard deviation of rl_after and of the gain over sft_after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from demo import REPO, evaluate, rl_stage


def summary(scores: list[float], sft_after: float) -> dict[str, float]:
    """Mean and standard deviation of `scores` and of their gains over `sft_after`. Pure."""
    spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
    mean = statistics.fmean(scores)
    return {"rl_after_mean": mean, "gain_mean": mean - sft_after, "std": spread}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=REPO / "runs", help="a finished demo's runs dir")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--engines", nargs="+", choices=("in_process", "vllm"), default=None)
    p.add_argument("--vllm", help="the vllm program (default: $FNT_VLLM, .venv-vllm/bin/vllm)")
    p.add_argument("--max-steps", type=int, help="RL steps (default: rl.toml's)")
    args = p.parse_args(argv)
    engines = args.engines or ["in_process", "vllm"]
    runs = args.runs.resolve()
    sft_hf, data = runs / "reverse-sft-hf", runs / "reverse-data"
    if not (sft_hf / "config.json").is_file() or not (data / "heldout.jsonl").is_file():
        sys.exit(f"error: {runs} holds no demo SFT result: run demo.py --runs {runs} --skip-rl")
    extra = () if args.max_steps is None else (f"--max-steps={args.max_steps}",)

    sft_after = evaluate(sft_hf, data, "the SFT model")
    results: list[dict] = []
    for seed in args.seeds:
        for engine in engines:
            out = runs / "compare" / f"{engine}-{seed}"
            shutil.rmtree(out, ignore_errors=True)  # a rerun starts over
            out.mkdir(parents=True)
            started = time.time()
            score = rl_stage(
                sft_hf, data, out / "rl", out / "hf", seed=seed, engine=engine,
                vllm=args.vllm, extra=extra,
            )  # fmt: skip
            row = {"engine": engine, "seed": seed, "rl_after": score}
            results.append({**row, "seconds": round(time.time() - started, 1)})
            print("run: " + json.dumps(results[-1]), flush=True)
    by_engine = {
        engine: summary([r["rl_after"] for r in results if r["engine"] == engine], sft_after)
        for engine in engines
    }
    for engine, s in by_engine.items():
        print(
            f"{engine}: rl_after {s['rl_after_mean']:.4f} +- {s['std']:.4f} "
            f"(gain {s['gain_mean']:+.4f}) over seeds {args.seeds}",
            flush=True,
        )
    print(json.dumps({"sft_after": sft_after, "engines": by_engine, "runs": results}))


if __name__ == "__main__":
    main()
