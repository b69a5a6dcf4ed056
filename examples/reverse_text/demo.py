"""The reverse-text demo: tiny model -> SFT -> DPO and RL, with held-out evals in between.
Side effects: writes under --runs and runs the scripts in subprocesses.

Its last line is one JSON object: {"sft_before": ..., "sft_after": ..., "dpo_after": ...,
"rl_after": ...}, the mean held-out similarity (greedy decoding, the same 200 prompts) of the
base model, the SFT result, the DPO result and the RL result. DPO and RL each start from the SFT
result (DPO on pairs of a correct and a corrupted reversal, `dpo.toml`), so the two stages are
compared on the same start.

`--engine vllm` generates the RL stage's rollouts with a vLLM server (rollout.engine = "vllm"),
which the demo starts on 127.0.0.1 with `fnt vllm-serve` (vLLM from `make vllm-env`) and stops
after the stage; the default is the in-process engine.
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
    """The environment of the scripts: one OpenMP thread unless OMP_NUM_THREADS says otherwise,
    and the repository on the path (the environments' module, examples.reverse_text).

    The trainer takes runtime.num_threads from the configs; this is for the other scripts. The
    models are tiny, and on a 2-core machine shared with other processes two threads stall each
    other (the eval took 75 s instead of 8 s).
    """
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def run(*args: str) -> None:
    """Run a repository script with this interpreter; its output streams to the console."""
    subprocess.run([sys.executable, *args], cwd=REPO, env=script_env(), check=True)


def last_json(*args: str) -> dict:
    """Run a repository script as `run` does, its output printed too; its last line's JSON."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    print(proc.stdout, end="", flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def export_last(run_dir: Path, out: Path) -> None:
    """Export the last checkpoint of the run in `run_dir` (its max_steps) to `out`."""
    steps = json.loads((run_dir / "config.json").read_text())["max_steps"]
    checkpoint = run_dir / "checkpoints" / f"step_{steps}"
    run("scripts/export_hf.py", "--checkpoint", str(checkpoint), "--out", str(out))


def evaluate(model: Path, data: Path, label: str) -> float:
    """Mean held-out similarity of `model`, as eval.py's last line reports it; a line before it
    says which model it scores (`label`: the base model, the SFT model, ...)."""
    print(f"held-out similarity of {label} ({model}):", flush=True)
    heldout = str(data / "heldout.jsonl")
    return last_json(str(HERE / "eval.py"), "--model", str(model), "--data", heldout)["similarity"]


def rl_with_vllm(rl_run: list[str], rl_config: list[str], log: Path, vllm: str | None) -> None:
    """Run the RL stage against a vLLM server started for it (its output in `log`)."""
    from fnt.apps.vllm_serve import has_cuda, local_server

    # A small KV cache is plenty for 192 samples of <= 50 tokens; on a CPU the memory fraction
    # is of the machine's RAM and only has to pass vLLM's start-up check.
    settings = ["--rollout.vllm.kv_cache_gb=1", "--rollout.vllm.gpu_memory_utilization=0.3"]
    # On a CPU, compiling the model would take longer than the stage saves.
    extra = [] if has_cuda() else ["--enforce-eager"]
    print(f"starting a vLLM server (its output: {log})", flush=True)
    with local_server([*rl_config, *settings], log, vllm=vllm, extra=extra) as server:
        urls = json.dumps([server.url])
        run(*rl_run, *settings, "--rollout.engine", "vllm", "--rollout.vllm.urls", urls)


def rl_stage(
    sft_hf: Path,
    data: Path,
    rl_dir: Path,
    rl_hf: Path,
    *,
    seed: int,
    engine: str,
    vllm: str | None = None,
    extra: tuple[str, ...] = (),
) -> float:
    """RL from the exported SFT model `sft_hf` into `rl_dir` (a vLLM server's output in
    rl_dir/../vllm-server.log), its last checkpoint exported to `rl_hf`; the held-out
    similarity of the result. `extra`: more config overrides."""
    rl_config = ["--config", str(HERE / "rl.toml"), "--model.name", str(sft_hf)]
    rl_config += ["--seed", str(seed), "--rollout.prompts", str(data / "rl.jsonl"), *extra]
    rl_run = ["scripts/rl.py", *rl_config, "--output-dir", str(rl_dir)]
    if engine == "vllm":
        rl_with_vllm(rl_run, rl_config, rl_dir.parent / "vllm-server.log", vllm)
    else:
        run(*rl_run)
    export_last(rl_dir, rl_hf)
    return evaluate(rl_hf, data, "the RL model")


def dpo_stage(sft_hf: Path, data: Path, dpo_dir: Path, dpo_hf: Path, *, seed: int) -> float:
    """DPO from the exported SFT model `sft_hf` into `dpo_dir`, exported to `dpo_hf`; the
    held-out similarity of the result."""
    sources = json.dumps([{"path": str(data / "dpo.jsonl")}])
    val = json.dumps([{"path": str(data / "dpo_val.jsonl")}])
    args = ["--config", str(HERE / "dpo.toml"), "--model.name", str(sft_hf), "--seed", str(seed)]
    args += ["--output-dir", str(dpo_dir), "--data.sources", sources]
    args += ["--val.sources", val, "--val.interval", "20"]
    run("scripts/dpo.py", *args)
    export_last(dpo_dir, dpo_hf)
    return evaluate(dpo_hf, data, "the DPO model")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runs", type=Path, default=REPO / "runs", help="where models, data and runs go"
    )
    p.add_argument("--skip-rl", action="store_true", help="leave out the RL stage")
    p.add_argument("--skip-dpo", action="store_true", help="leave out the DPO stage")
    p.add_argument(
        "--engine",
        choices=("in_process", "vllm"),
        default="in_process",
        help="the RL stage's rollout engine (vllm: a local server, from make vllm-env)",
    )
    p.add_argument("--vllm", help="the vllm program (default: $FNT_VLLM, .venv-vllm/bin/vllm)")
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
    dpo_dir, dpo_hf = runs / "reverse-dpo", runs / "reverse-dpo-hf"
    # A rerun starts over (the model too: make-tiny-model replaces only a model it marked, and
    # one written by an older fnt has no mark).
    for stale in (model, sft_dir, sft_hf, rl_dir, rl_hf, dpo_dir, dpo_hf):
        shutil.rmtree(stale, ignore_errors=True)
    started = time.time()
    seconds: dict[str, float] = {}  # wall time of each stage: its run, export and eval

    seed = ("--seed", str(args.seed))
    run("scripts/make_tiny_model.py", "--out", str(model), *TINY_MODEL, *seed)
    run(str(HERE / "make_data.py"), "--out", str(data), *seed)
    result = {"sft_before": evaluate(model, data, "the base model, before SFT")}
    seconds["setup"] = time.time() - started

    sources = json.dumps([{"path": str(data / "sft.jsonl")}])
    sft_args = ["--model.name", str(model), "--output-dir", str(sft_dir), "--data.sources", sources]
    run("scripts/sft.py", "--config", str(HERE / "sft.toml"), *sft_args, *seed)
    export_last(sft_dir, sft_hf)
    result["sft_after"] = evaluate(sft_hf, data, "the SFT model")
    seconds["sft"] = time.time() - started - sum(seconds.values())

    if not args.skip_dpo:
        result["dpo_after"] = dpo_stage(sft_hf, data, dpo_dir, dpo_hf, seed=args.seed)
        seconds["dpo"] = time.time() - started - sum(seconds.values())

    if not args.skip_rl:
        result["rl_after"] = rl_stage(
            sft_hf, data, rl_dir, rl_hf, seed=args.seed, engine=args.engine, vllm=args.vllm
        )
        seconds["rl"] = time.time() - started - sum(seconds.values())

    print(f"demo took {time.time() - started:.0f} s", flush=True)
    # Wall seconds per stage (setup: model, data, base eval; sft, dpo, rl: run, export, eval).
    print("stage seconds: " + json.dumps({k: round(v, 1) for k, v in seconds.items()}), flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
