"""Held-out accuracy of a model on a reasoning-gym task, through fnt's own integration: the
held-out prompts an RL run with the same rollout.reasoning_gym settings evaluates on (never
among its training prompts), greedy answers, each scored by the task's own scorer.

Prints one JSON object: {"model": ..., "accuracy": ..., "score": ..., "n": ...}, accuracy being
the fraction of answers the scorer gives 1.0 and score the scorer's mean (what val/reward/mean
reports).

    python examples/reverse_text/eval_task.py --model HF_DIR [--task spell_backward]
        [--param max_word_len=10 ...] [--size 10000] [--val-size 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt.config import RolloutConfig
from fnt.config.schema import ReasoningGymConfig, TaskConfig
from fnt.rollout import generate
from fnt.rollout.environments import environment_of
from fnt.rollout.prompts import source_prompts


def held_out_accuracy(model_dir: Path, rollout: RolloutConfig, max_new_tokens: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    environment, name = environment_of(rollout)
    prompts, _, _ = source_prompts(
        environment.prompt_sources("val"), tokenizer, environment.start, name
    )
    groups = generate(
        model,
        [p.token_ids for p in prompts],
        num_samples=1,
        max_new_tokens=max_new_tokens,
        stop_token_ids={tokenizer.eos_token_id},
        greedy=True,
    )
    scores = []
    for (completion,), prompt in zip(groups, prompts):
        text = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        messages = [*prompt.messages, {"role": "assistant", "content": text}]
        scores += list(environment.score(prompt.record, messages).values())
    return {
        "accuracy": sum(s == 1.0 for s in scores) / len(scores),
        "score": sum(scores) / len(scores),
        "n": len(scores),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--task", default="spell_backward")
    p.add_argument("--param", action="append", default=[], help='a task setting "key=value"')
    p.add_argument("--size", type=int, default=10000, help="rollout.reasoning_gym.size")
    p.add_argument("--val-size", type=int, default=200, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0, help="rollout.reasoning_gym.seed")
    p.add_argument("--answer", choices=("tag", "text"), default="text")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    rollout = RolloutConfig(
        environment="reasoning_gym",
        reasoning_gym=ReasoningGymConfig(
            tasks=(TaskConfig(args.task, params=tuple(args.param)),),
            seed=args.seed,
            size=args.size,
            val_size=args.val_size,
            answer=args.answer,
        ),
    )
    scores = held_out_accuracy(args.model, rollout, args.max_new_tokens)
    print(json.dumps({"model": str(args.model), **scores}))


if __name__ == "__main__":
    main()
