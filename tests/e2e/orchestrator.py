"""A stand-alone orchestrator for the external rollout protocol (docs/external_rollouts.md).

For steps 1..N it waits for the trainer's weights/step_{N-1}, loads them with transformers,
samples completions, scores them, and writes rollouts/step_N. It knows the protocol only through
the files; fnt's generate() is used merely as a convenient sampler, and fnt.store.transaction writes
the rollout directory (files, then COMPLETE, then the rename, all fsynced). Prints one JSON line at
the end with what it saw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt.rollout import generate
from fnt.store.transaction import begin_dir_, commit_dir_


def wait_for(path: Path, timeout: float = 120.0) -> None:
    started = time.time()
    while not path.exists():
        if time.time() - started > timeout:
            raise TimeoutError(f"orchestrator: no {path}")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args()
    seen = []
    for step in range(1, args.steps + 1):
        weights = args.run / "weights" / f"step_{step - 1}"
        wait_for(weights / "COMPLETE")
        digest = hashlib.sha256((weights / "model.safetensors").read_bytes()).hexdigest()[:16]
        tok = AutoTokenizer.from_pretrained(weights)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"say {step}"}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(
            prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        )
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            (completions,) = generate(
                model,
                [prompt],
                num_samples=args.samples,
                max_new_tokens=8,
                stop_token_ids={tok.eos_token_id},
                temperature=1.0,
                generators=[gen],
            )
        rewards = [float(sum(c.token_ids) % 5) for c in completions]  # varies, so advantages do
        mean = sum(rewards) / len(rewards)
        out = args.run / "rollouts" / f"step_{step}"
        partial = begin_dir_(out)
        with open(partial / "samples.jsonl", "w") as fh:
            for c, r in zip(completions, rewards):
                fh.write(
                    json.dumps(
                        {
                            "prompt_ids": prompt,
                            "completion_ids": list(c.token_ids),
                            "inference_logprobs": list(c.logprobs),
                            "reward": r,
                            "advantage": r - mean,
                            "temperature": 1.0,
                        }
                    )
                    + "\n"
                )
        commit_dir_(partial, out)
        seen.append({"step": step, "weights": step - 1, "sha": digest})
    print(json.dumps({"seen": seen}), flush=True)


if __name__ == "__main__":
    main()
