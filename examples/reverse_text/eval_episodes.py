"""Held-out episodes of the reverse-text multi-turn tasks, decoded greedily (reads a model and a
JSONL file).

Each held-out prompt is one episode of an environment of examples/reverse_text/environments.py,
run by fnt's own episode runner (fnt.rollout.environments.episodes) with every turn of all
episodes decoded in one greedy batch. Prints one JSON object, with "model" (the directory
scored) and:
- --environment feedback (a wrong reversal gets a hint and one more try): {"single_turn": ...,
  "multi_turn": ..., "turns": ..., "n": ...}: the mean similarity of the first answer (what a
  single-turn episode scores), of the last answer (the episode's reward), and the mean turns;
- --environment lookup_tool (the word to reverse is known only to a tool): {"reward": ...,
  "tool_calls": ..., "turns": ..., "n": ...}: the mean similarity of the last answer to the
  reversal (the episode's reward), the mean tool calls and model turns per episode.

    python examples/reverse_text/eval_episodes.py --model HF_DIR --data DATA/heldout.jsonl \
        [--environment feedback|lookup_tool]
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

from examples.reverse_text import environments  # noqa: E402
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


def heldout_episodes(
    model_dir: Path, data: Path, max_turns: int, max_new_tokens: int, name: str = "feedback"
) -> dict:
    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    environment = getattr(environments, name)(None)
    prompts = load_prompts(data, tokenizer, environment.start)
    rules = EpisodeRules(
        group_size=1,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        max_episode_tokens=512,
        on_truncated="score",
        on_bad_reward="error",
        std_normalize=False,
        prompts_path=str(data),
        name=f"environment '{name}'",
        reward_name=name,
    )
    sampler = GreedyTurns(model, stop_token_ids(tokenizer, model_dir))
    episodes = [g[0] for g in run_episodes(prompts, sampler, environment, tokenizer, rules)]
    scores = [environment.score(e.prompt.record, e.messages) for e in episodes]
    n = len(episodes)
    if name == "lookup_tool":
        return {
            "reward": sum(scores) / n,
            "tool_calls": sum(e.tool_calls for e in episodes) / n,
            "turns": sum(e.turns for e in episodes) / n,
            "n": n,
        }
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
    p.add_argument("--environment", choices=["feedback", "lookup_tool"], default="feedback")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument(
        "--max-new-tokens", type=int, default=0, help="per turn; 0: 16, or 64 for lookup_tool"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    limit = args.max_new_tokens or (64 if args.environment == "lookup_tool" else 16)
    episodes = heldout_episodes(args.model, args.data, args.max_turns, limit, args.environment)
    print(json.dumps({"model": str(args.model), **episodes}))


if __name__ == "__main__":
    main()
