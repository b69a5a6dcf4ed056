"""The reverse-text demo on a real task: tiny model -> SFT on reverse-text chats -> RL on
reasoning-gym's spell_backward task ("Spell this word backward (example: sun -> nus): word"),
generated and scored by reasoning-gym (rollout.environment = "reasoning_gym"; pip install
'fnt[tasks]'). Side effects: writes under --runs and runs the scripts in subprocesses.

The SFT stage (sft.toml, 300 steps) teaches reversing random strings asked as "reverse: abc";
the task asks for real words in reasoning-gym's own wording, which the model never saw. RL then
trains on the task's training prompts (dataset seeds 0..9999), rewarded by the task's scorer
(1 for the reversed word, case-insensitive; else the fraction of leading letters right).

Its last line is one JSON object: the held-out accuracy (fraction of answers the scorer gives
1.0) and mean score of the SFT and the RL result on the same 200 held-out prompts (seeds from
10000 on, none a training question; examples/reverse_text/eval_task.py, greedy).

    python examples/reverse_text/demo_task.py [--runs runs] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from examples.reverse_text.demo import TINY_MODEL, export_last, last_json, run  # noqa: E402

TASK = "spell_backward"
# Words of 4-10 letters, the lengths of the SFT strings.
PARAMS = ["min_word_len=4", "max_word_len=10"]
SIZE, VAL_SIZE = 10000, 200
# Measured (seed 0, 2 shared cores): 140 SFT + 100 RL steps gave held-out score 0.12 -> 0.76,
# accuracy 0 -> 0 (answers ran on past the word; the scorer gives a right prefix of a longer
# answer 0.8); 140 + 200 with on_truncated = "zero": 0.12 -> 0.83, accuracy 0 -> 0.005 (197 s);
# 300 + 300: score 0.14 -> 0.93, accuracy 0 -> 0.29 (292 s).
SFT_STEPS = 300
RL_STEPS = 300
MAX_NEW_TOKENS = 12  # rl.toml's: 10 letters and the end of the turn


def evaluate(model: Path) -> dict:
    """Held-out accuracy and score of `model` on the task, as eval_task.py's last line."""
    args = [str(HERE / "eval_task.py"), "--model", str(model), "--task", TASK]
    args += [f"--param={p}" for p in PARAMS]
    args += ["--size", str(SIZE), "--val-size", str(VAL_SIZE), "--answer", "text"]
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS)]
    return last_json(*args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=REPO / "runs", help="where everything goes")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, data and runs")
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="SFT steps")
    p.add_argument("--rl-steps", type=int, default=RL_STEPS, help="RL steps")
    args = p.parse_args(argv)
    runs = args.runs.resolve()
    model, data = runs / "reverse-model", runs / "reverse-data"
    sft_dir, sft_hf = runs / "task-sft", runs / "task-sft-hf"
    rl_dir, rl_hf = runs / "task-rl", runs / "task-rl-hf"
    for stale in (model, sft_dir, sft_hf, rl_dir, rl_hf):  # a rerun starts over
        shutil.rmtree(stale, ignore_errors=True)
    started = time.time()
    seconds: dict[str, float] = {}
    seed = ("--seed", str(args.seed))

    run("scripts/make_tiny_model.py", "--out", str(model), *TINY_MODEL, *seed)
    run(str(HERE / "make_data.py"), "--out", str(data), *seed)
    seconds["setup"] = time.time() - started

    sources = json.dumps([{"path": str(data / "sft.jsonl")}])
    sft_args = ["--model.name", str(model), "--output-dir", str(sft_dir), "--data.sources", sources]
    sft_args += ["--max-steps", str(args.sft_steps)]
    run("scripts/sft.py", "--config", str(HERE / "sft.toml"), *sft_args, *seed)
    export_last(sft_dir, sft_hf)
    before = evaluate(sft_hf)
    seconds["sft"] = time.time() - started - sum(seconds.values())

    # rl.toml's settings, with prompts generated and scored by reasoning-gym: 16 prompts x 8
    # samples a step; the task's prompts are longer than the reverse-text ones (2 a row).
    tasks = json.dumps([{"name": TASK, "params": PARAMS}])
    rl_args = ["--config", str(HERE / "rl.toml"), "--model.name", str(sft_hf), *seed]
    rl_args += ["--output-dir", str(rl_dir), "--rollout.prompts=", "--rollout.reward="]
    rl_args += ["--rollout.environment", "reasoning_gym", "--rollout.reasoning_gym.tasks", tasks]
    rl_args += ["--rollout.reasoning_gym.answer", "text"]
    rl_args += ["--rollout.reasoning_gym.size", str(SIZE)]
    rl_args += ["--rollout.prompts-per-step", "16", "--batch-size", "64"]
    # An answer cut off at max_new_tokens never stopped: reward 0, so that RL learns to stop.
    rl_args += ["--rollout.on-truncated", "zero"]
    rl_args += ["--max-steps", str(args.rl_steps), "--schedule.warmup-steps", "10"]
    run("scripts/rl.py", *rl_args)
    export_last(rl_dir, rl_hf)
    after = evaluate(rl_hf)
    seconds["rl"] = time.time() - started - sum(seconds.values())

    print(f"task demo took {time.time() - started:.0f} s", flush=True)
    print("stage seconds: " + json.dumps({k: round(v, 1) for k, v in seconds.items()}), flush=True)
    result = {
        "task": TASK,
        "heldout": VAL_SIZE,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "score_before": round(before["score"], 4),
        "score_after": round(after["score"], 4),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
