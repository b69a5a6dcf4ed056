"""`fnt generate --checkpoint DIR (--prompt TEXT... | --prompts FILE.jsonl)`: a model's answers
to prompts, rendered with its chat template, without exporting first. Side effects: loads the
model, generates, prints.

DIR is a checkpoint (RUN/checkpoints/step_N, LoRA ones included: loaded as `fnt export` loads
them, fnt.apps.export.load_trained_model) or a Hugging Face model directory. The prompts are
rollout.prompts' records (`{"prompt": ...}` or `{"messages": [...]}`, fnt.rollout.prompts); a
--prompt TEXT is one user message. Answers are greedy by default, through the function
validation generates with (fnt.evaluation.greedy_answers), so they are the answers `val.prompts`
scores; with --temperature > 0, --n sampled answers per prompt, each prompt drawing from a
generator seeded by (--seed, its index) (fnt.rollout.sampling). Generation stops at the
model's end-of-turn tokens or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fnt generate",
        description="Answer prompts with a checkpoint (LoRA included) or a Hugging Face model.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a complete RUN/checkpoints/step_N, or a Hugging Face model directory",
    )
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--prompt", action="append", help="a user message to answer (repeat for several)"
    )
    given.add_argument(
        "--prompts", help='a JSONL file of {"prompt": ...} or {"messages": [...]} records'
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default): greedy answers"
    )
    parser.add_argument("--n", type=int, default=1, help="sampled answers per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampled answers")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per answer instead of text"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from fnt.apps.preflight import check_generate
    from fnt.config import ConfigError

    args = parse_args(argv)
    if args.max_new_tokens < 1 or args.n < 1 or args.temperature < 0:
        raise ConfigError(
            f"--max-new-tokens and --n must be >= 1 and --temperature >= 0, got "
            f"{args.max_new_tokens}, {args.n} and {args.temperature}"
        )
    if args.temperature == 0 and args.n > 1:
        raise ConfigError(f"--n {args.n} needs --temperature > 0: greedy answers are all alike")
    kind = check_generate(args.checkpoint, args.prompts)
    model, tokenizer, stops = load_generator(args.checkpoint, kind)
    prompts = read_prompts(tokenizer, args.prompts, args.prompt)
    answers = answer(
        model,
        prompts,
        stops,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        n=args.n,
        seed=args.seed,
    )
    for prompt, completions in zip(prompts, answers):
        for index, completion in enumerate(completions):
            print(answer_text(prompt, index, completion, tokenizer, args.json), flush=True)


def load_generator(path: Path, kind: str) -> tuple[Any, Any, frozenset[int]]:
    """The model in eval mode (float32; on the GPU when there is one), its tokenizer and stop
    tokens, from a checkpoint (`kind` "checkpoint": its base model's tokenizer) or a model
    directory ("model")."""
    import torch

    from fnt.apps.export import check_base, load_trained_model
    from fnt.config import ModelConfig
    from fnt.model.loading import load_hf_model
    from fnt.model.tokenizer import load_tokenizer, stop_token_ids

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "checkpoint":
        base = check_base(path)
        model = load_trained_model(path).to(device)
    else:
        base = str(path)
        model = load_hf_model(ModelConfig(name=base, dtype="float32"), device).eval()
    tokenizer = load_tokenizer(base)
    return model, tokenizer, stop_token_ids(tokenizer, base)


def read_prompts(tokenizer: Any, path: Optional[str], texts: Optional[Sequence[str]]) -> list:
    """The prompts of the JSONL file at `path` (fnt.rollout.prompts.load_prompts), or one user
    message per text, rendered with the chat template."""
    from fnt.errors import DataError
    from fnt.rollout.prompts import Prompt, load_prompts, prompt_messages, render_prompt

    if path is not None:
        return list(load_prompts(path, tokenizer))
    prompts = []
    for number, text in enumerate(texts or (), 1):
        record = {"prompt": text}
        messages = prompt_messages(record)
        try:
            token_ids = render_prompt(messages, tokenizer)
        except ValueError as e:
            raise DataError(f"--prompt number {number}: {e}") from e
        prompts.append(Prompt(record=record, token_ids=tuple(token_ids), line=number))
    return prompts


def answer(
    model: Any,
    prompts: Sequence[Any],
    stops: frozenset[int],
    *,
    max_new_tokens: int,
    temperature: float,
    n: int,
    seed: int,
) -> list[list[Any]]:
    """Per prompt, its answers as fnt.rollout.sampling.Completion: the greedy one
    (temperature 0, validation's fnt.evaluation.greedy_answers), else `n` sampled ones."""
    import torch

    from fnt.evaluation import greedy_answers
    from fnt.rollout.sampling import Completion, generate, sampling_seed

    if temperature == 0:
        answers = greedy_answers(
            model, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops
        )
        return [[Completion(ids, (), stopped=bool(ids) and ids[-1] in stops)] for ids in answers]
    device = next(model.parameters()).device
    generators = [
        torch.Generator(device).manual_seed(sampling_seed(seed, 0, i)) for i in range(len(prompts))
    ]
    return generate(
        model,
        [prompt.token_ids for prompt in prompts],
        num_samples=n,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stops,
        temperature=temperature,
        generators=generators,
    )


def answer_text(prompt: Any, index: int, completion: Any, tokenizer: Any, as_json: bool) -> str:
    """One answer: a JSON object (`line`, `sample`, `prompt`: its messages, `answer`: the text
    without special tokens, `tokens`, `stopped`), or a header and the text."""
    text = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    messages = list(prompt.messages) or [{"role": "user", "content": prompt.record["prompt"]}]
    if as_json:
        return json.dumps(
            {
                "line": prompt.line,
                "sample": index,
                "prompt": messages,
                "answer": text,
                "tokens": len(completion.token_ids),
                "stopped": completion.stopped,
            }
        )
    ending = "stopped" if completion.stopped else "cut at --max-new-tokens"
    return (
        f"== prompt {prompt.line}"
        + (f", answer {index + 1}" if index else "")
        + f" ({len(completion.token_ids)} tokens, {ending}): {messages[-1]['content']!r}\n{text}"
    )
