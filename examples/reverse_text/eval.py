"""Held-out similarity of a model on the reverse-text task (reads a model and a JSONL file).

The held-out prompts decode greedily, all in one batch; the score is the mean
difflib.SequenceMatcher ratio between the completion and the true reversal. Prints one JSON
object: {"model": ..., "similarity": ..., "n": ...}.

    python examples/reverse_text/eval.py --model HF_DIR --data DATA/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt.rollout import generate, prompt_messages, render_prompt
from fnt.rollout.rewards import similarity


def heldout_similarity(model_dir: Path, data: Path, limit: int, max_new_tokens: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
    prompts = [render_prompt(prompt_messages(record), tokenizer) for record in records]
    groups = generate(
        model,
        prompts,
        num_samples=1,
        max_new_tokens=max_new_tokens,
        stop_token_ids={tokenizer.eos_token_id},
        greedy=True,
    )
    scores = [
        similarity(tokenizer.decode(list(completion.token_ids), skip_special_tokens=True), record)
        for (completion,), record in zip(groups, records)
    ]
    return {"model": str(model_dir), "similarity": sum(scores) / len(scores), "n": len(scores)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--data", type=Path, required=True, help="held-out JSONL with prompt and answer")
    p.add_argument("--limit", type=int, default=200, help="prompts to evaluate")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    print(json.dumps(heldout_similarity(args.model, args.data, args.limit, args.max_new_tokens)))


if __name__ == "__main__":
    main()
