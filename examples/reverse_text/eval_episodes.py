"""Held-out episodes of the reverse-text feedback task, decoded greedily (reads a model and a
JSONL file).

Each held-out prompt is one episode of examples/reverse_text/environments.py:feedback (a wrong
reversal gets a hint, the first half of the true reversal, and one more try), run by fnt's own
episode runner (fnt.rollout.environments.episodes) with every turn of all episodes decoded in
one greedy batch. Prints one JSON object: {"single_turn": ..., "multi_turn": ..., "turns": ...,
"n": ...}: the mean similarity of the first answer (what a single-turn episode scores), of the
last answer (the episode's reward), and the mean model turns.

    python examples/reverse_text/eval_episodes.py --model HF_DIR --data DATA/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.reverse_text.environments

from examples.reverse_text.environments import feedback  # noqa: E402
from fnt.model.tokenizer import load_tokenizer, stop_token_ids  # noqa: E402
from fnt.rollout import generate  # noqa: E402
from fnt.rollout.environments.episodes import EpisodeRules, run_episodes  # noqa: E402
from fnt.rollout.prompts import load_prompts  # noqa: E402


class GreedyTurns:
    """A TurnSampler (fnt.rollout.environments.episodes) that decodes every turn greedily."""

    def __init__(self, model, stops) -> None:
        self.model, self.stops = model, stops

    def _generate(self, prompts, max_new_tokens):
        return generate(
            self.model,
            prompts,
            num_samples=1,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stops,
            greedy=True,
        )

    def first(self, prompts, num_samples, max_new_tokens):
        return self._generate(prompts, max_new_tokens)

    def next(self, contexts, max_new_tokens, keys):
        return [group[0] for group in self._generate(contexts, list(max_new_tokens))]


def heldout_episodes(model_dir: Path, data: Path, max_turns: int, max_new_tokens: int) -> dict:
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    environment = feedback(None)
    prompts = load_prompts(data, tokenizer, environment.start)
    rules = EpisodeRules(
        group_size=1,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        max_episode_tokens=256,
        on_truncated="score",
        on_bad_reward="error",
        std_normalize=False,
        prompts_path=str(data),
        name="environment 'feedback'",
    )
    sampler = GreedyTurns(model, stop_token_ids(tokenizer, model_dir))
    episodes = [g[0] for g in run_episodes(prompts, sampler, environment, tokenizer, rules)]
    scores = [environment.score(e.prompt.record, e.messages) for e in episodes]
    n = len(episodes)
    return {
        "single_turn": sum(s["first"] for s in scores) / n,
        "multi_turn": sum(s["final"] for s in scores) / n,
        "turns": sum(e.turns for e in episodes) / n,
        "n": n,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--data", type=Path, required=True, help="held-out JSONL with prompt and answer")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(heldout_episodes(args.model, args.data, args.max_turns, args.max_new_tokens)))


if __name__ == "__main__":
    main()
