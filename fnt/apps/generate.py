"""`fnt generate --checkpoint DIR (--prompt TEXT... | --prompts FILE.jsonl)`: a model's answers
to prompts, rendered with its chat template, without exporting first. Side effects: loads the
model, generates, prints.

DIR is a checkpoint (RUN/checkpoints/step_N, LoRA ones included: loaded as `fnt export` loads
them, fnt.apps.export.load_trained_model) or a Hugging Face model directory. The prompts are
rollout.prompts' records (`{"prompt": ...}` or `{"messages": [...]}`, fnt.rollout.prompts); a
--prompt TEXT is one user message. Answers are greedy by default, through the function
validation generates with (fnt.evaluation.held_out.greedy_answers), so they are the
answers `val.prompts` scores; with --temperature > 0, --n sampled answers per prompt, each
prompt drawing from a generator seeded by (--seed, its index) (fnt.rollout.sampling).
Generation stops at the model's end-of-turn tokens or after --max-new-tokens. A prompt that
leaves no room for --max-new-tokens in the model's context (max_position_embeddings) is an error
naming it, before the weights load; with --truncate-prompts it is cut from the left instead, one
line on stderr saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
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
        help="a complete RUN/checkpoints/step_N, a Hugging Face model directory, or a Hub id "
        "(org/name, from the huggingface_hub cache; downloaded when missing)",
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
    parser.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="cut a prompt that leaves no room for --max-new-tokens in the model's context "
        "(max_position_embeddings) from the left, saying so on stderr; without it such a "
        "prompt is an error",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from fnt.apps.preflight import check_generate
    from fnt.config import ConfigError
    from fnt.model.hub import hub_snapshot, is_hub_id

    args = parse_args(argv)
    if args.max_new_tokens < 1 or args.n < 1 or args.temperature < 0:
        raise ConfigError(
            f"--max-new-tokens and --n must be >= 1 and --temperature >= 0, got "
            f"{args.max_new_tokens}, {args.n} and {args.temperature}"
        )
    if args.temperature == 0 and args.n > 1:
        raise ConfigError(f"--n {args.n} needs --temperature > 0: greedy answers are all alike")
    if is_hub_id(str(args.checkpoint)):
        args.checkpoint = Path(hub_snapshot(str(args.checkpoint), key="--checkpoint"))
    kind = check_generate(args.checkpoint, args.prompts)
    # The prompts are rendered and measured against the model's context before its weights load.
    base, tokenizer, stops = load_tokenizer_of(args.checkpoint, kind)
    prompts = fit_context(
        read_prompts(tokenizer, args.prompts, args.prompt),
        context_of(base),
        args.max_new_tokens,
        truncate=args.truncate_prompts,
        where=prompt_place(args.prompts),
    )
    model = load_generator(args.checkpoint, kind)
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


def load_tokenizer_of(path: Path, kind: str) -> tuple[str, Any, frozenset[int]]:
    """The model directory whose tokenizer and config a checkpoint (`kind` "checkpoint": its
    base model) or model directory ("model") at `path` uses, that tokenizer and its stop
    tokens."""
    from fnt.apps.export import check_base
    from fnt.model.tokenizer import load_tokenizer, stop_token_ids

    base = check_base(path) if kind == "checkpoint" else str(path)
    tokenizer = load_tokenizer(base)
    return base, tokenizer, stop_token_ids(tokenizer, base)


def load_generator(path: Path, kind: str) -> Any:
    """The model in eval mode (float32; on the GPU when there is one), from a checkpoint
    (`kind` "checkpoint") or a model directory ("model")."""
    import torch

    from fnt.apps.export import load_trained_model
    from fnt.config import ModelConfig
    from fnt.model.loading import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "checkpoint":
        return load_trained_model(path).to(device)
    return load_hf_model(ModelConfig(name=str(path), dtype="float32"), device).eval()


def context_of(model_dir: str) -> Optional[int]:
    """The positions the model at `model_dir` has (config.json's max_position_embeddings, or a
    text config's inside it), or None when it names none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        positions = section.get("max_position_embeddings")
        if isinstance(positions, int) and positions > 0:
            return positions
    return None


def prompt_place(path: Optional[str]) -> Callable[[Any], str]:
    """How a message names a prompt: `--prompts FILE, line N` or `--prompt number N`."""
    if path is not None:
        return lambda prompt: f"--prompts {path!r}, line {prompt.line}"
    return lambda prompt: f"--prompt number {prompt.line}"


def fit_context(
    prompts: list,
    context: Optional[int],
    max_new_tokens: int,
    *,
    truncate: bool,
    where: Callable[[Any], str],
) -> list:
    """`prompts` with room for `max_new_tokens` in the model's `context` positions: a prompt
    longer than `context - max_new_tokens` tokens is a DataError naming it (`where`) and the
    lengths, or with `truncate` keeps its last tokens, one line on stderr saying so. A model
    that names no context is not checked.

    Without this, transformers generates past the positions the model was trained on, with a
    warning, and the answer is nonsense."""
    import dataclasses

    from fnt.errors import ConfigError, DataError

    if context is None:
        return prompts
    room = context - max_new_tokens
    if room < 1:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"{context} positions (max_position_embeddings): lower it"
        )
    fitted = []
    for prompt in prompts:
        length = len(prompt.token_ids)
        if length > room:
            if not truncate:
                raise DataError(
                    f"{where(prompt)}: the prompt is {length} tokens, and with --max-new-tokens "
                    f"{max_new_tokens} that is {length + max_new_tokens} positions, more than the "
                    f"model's {context} (max_position_embeddings): shorten it, lower "
                    f"--max-new-tokens, or pass --truncate-prompts (keeps its last {room} tokens)"
                )
            print(
                f"note: {where(prompt)}: the prompt is {length} tokens; its first "
                f"{length - room} were cut (--truncate-prompts), leaving room for "
                f"--max-new-tokens {max_new_tokens} in the model's {context} positions",
                file=sys.stderr,
                flush=True,
            )
            prompt = dataclasses.replace(prompt, token_ids=prompt.token_ids[length - room :])
        fitted.append(prompt)
    return fitted


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
    """Per prompt, its answers as fnt.rollout.sampling.Completion: the greedy one (temperature
    0, validation's fnt.evaluation.held_out.greedy_answers), else `n` sampled ones."""
    import torch

    from fnt.evaluation.held_out import greedy_answers
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
