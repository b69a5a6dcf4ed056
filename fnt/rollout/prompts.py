"""RL prompts: read a JSONL file, render each prompt with the chat template, and the prompt order.
Side effects: `load_prompts` reads the file; rendering calls the environment's `start`; everything
else is pure.

Records: `{"prompt": str, ...}` is one user message; `{"messages": [...], ...}` is a chat whose last
message is not the assistant's. Either is rendered with `add_generation_prompt=True`, so the model
continues with the assistant's answer. Every field of the record stays available to the reward.

Order: the prompts of epoch e are a permutation seeded by (seed, e) (fnt.data.order with one
source), so the prompt at a data position (epoch, cursor) is a pure function of (seed, epoch,
cursor). An environment that makes its own prompts (`source_prompts`) has several sources, mixed
by weight the same way. Step N takes the next prompts_per_step prompts of that order, wrapping
into the next epoch, and rank r takes the r-th contiguous share of them
(fnt.distributed.parallel.rank_share); with rollout.filter_groups a step draws the next ones on
in rounds until it has its groups (fnt.rollout.engines.in_process), and the position it leaves
is recorded all the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from fnt.batch import DataPosition
from fnt.data.chat import check_message_list
from fnt.data.order import SampleOrder
from fnt.errors import DataError, UserCodeError
from fnt.rollout.user_code import raised
from fnt.store.jsonl import jsonl_records


@dataclass(frozen=True)
class Prompt:
    """One prompt of the JSONL file, rendered and tokenized."""

    record: Mapping[str, Any]
    """The JSONL record as read (what the reward function sees)."""
    token_ids: tuple[int, ...]
    """The rendered conversation up to and including the assistant's generation prompt."""
    line: int
    """1-based line number in the file, for error messages."""
    messages: tuple[Mapping[str, Any], ...] = ()
    """The episode's first messages (what `token_ids` renders)."""
    tools: Optional[tuple[Mapping[str, Any], ...]] = None
    """The tools' JSON schemas the template was given, or None."""


def prompt_messages(record: object) -> list[dict[str, Any]]:
    """The chat messages of a prompt record; ValueError says what is wrong with a bad record."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if ("prompt" in record) == ("messages" in record):
        raise ValueError(
            f"a prompt record has exactly one of 'prompt' or 'messages'; got keys {sorted(record)}"
        )
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(record['prompt']).__name__}")
        return [{"role": "user", "content": record["prompt"]}]
    messages = record["messages"]
    check_message_list(messages)
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            "the last message is the assistant's; a prompt ends where the answer starts"
        )
    return messages


def render_prompt(
    messages: Sequence[Mapping[str, Any]], tokenizer, tools: Optional[Sequence[Mapping]] = None
) -> list[int]:
    """Token ids of the conversation rendered with the generation prompt (and the tools' JSON
    schemas, when given), ready to continue."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template, which prompt rendering needs")
    extra = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **extra
    )
    # The template already wrote any special tokens it wants; the tokenizer must not add more.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(
    path: str | Path, tokenizer, start: Optional[Callable[[Any], Any]] = None
) -> tuple[Prompt, ...]:
    """Every prompt of a JSONL file; a bad line raises DataError naming the file and line.

    `start` (an environment's, fnt.rollout.environments.protocol) gives a record's first
    messages and tools; without it a record's messages are `prompt_messages`."""
    records = jsonl_records(path, f"the prompts file {path}")
    prompts = render_records(records, tokenizer, start, str(path))
    if not prompts:
        raise DataError(f"{path}: the file is empty (no JSONL prompt records)")
    return prompts


def started(start: Callable[[Any], Any], record: Any, where: str) -> Any:
    """An environment's start(record); a ValueError passes (what the record lacks: told as its
    line), any other exception is the environment's own failure (fnt.rollout.user_code)."""
    try:
        return start(record)
    except ValueError:
        raise
    except Exception as e:
        raise raised(f"the environment failed to start the prompt of {where}", e) from None


def render_records(
    numbered: Iterable[tuple[int, Any]],
    tokenizer,
    start: Optional[Callable[[Any], Any]],
    where: str,
) -> tuple[Prompt, ...]:
    """(line number, record) pairs as rendered prompts; DataError naming `where` and the line of
    a record that cannot be rendered."""
    prompts = []
    for line_number, record in numbered:
        try:
            if start is None:
                messages, tools = prompt_messages(record), None
            else:
                begun = started(start, record, f"{where}, line {line_number}")
                messages, tools = list(begun.messages), begun.tools
            token_ids = render_prompt(messages, tokenizer, tools)
        except UserCodeError:
            raise
        except ValueError as e:
            raise DataError(f"{where}, line {line_number}: {e}") from e
        if not token_ids:
            raise DataError(f"{where}, line {line_number}: the prompt renders to no tokens")
        prompts.append(
            Prompt(
                record=record,
                token_ids=tuple(token_ids),
                line=line_number,
                messages=tuple(dict(m) for m in messages),
                tools=None if tools is None else tuple(tools),
            )
        )
    return tuple(prompts)


def source_prompts(
    sources: Sequence[Any], tokenizer, start: Callable[[Any], Any], where: str
) -> tuple[tuple[Prompt, ...], tuple[int, ...], tuple[float, ...]]:
    """The prompts of an environment's prompt sources (fnt.rollout.environments.protocol.
    PromptSource), concatenated in source order, with each source's size and weight (what
    `prompt_order` mixes). A record's "line" is its 1-based number within its source."""
    prompts: list[Prompt] = []
    for source in sources:
        if not source.records:
            raise DataError(f"{where}: the prompt source {source.name!r} has no records")
        numbered = enumerate(source.records, start=1)
        prompts += render_records(numbered, tokenizer, start, f"{where} ({source.name})")
    sizes = tuple(len(source.records) for source in sources)
    weights = tuple(float(source.weight) for source in sources)
    if not sizes:
        raise DataError(f"{where}: the environment made no prompt sources")
    return tuple(prompts), sizes, weights


def prompt_order(
    num_prompts: int, seed: int, sizes: Sequence[int] = (), weights: Sequence[float] = ()
) -> SampleOrder:
    """The order prompts are drawn in: a fresh seeded permutation of all prompts every epoch;
    with `sizes` and `weights`, sources of those sizes (in prompt order) mixed by weight as SFT
    mixes data sources (fnt.data.order)."""
    if not sizes:
        sizes, weights = (num_prompts,), (1.0,)
    if sum(sizes) != num_prompts:
        raise ValueError(f"the sources' sizes {tuple(sizes)} do not add up to {num_prompts}")
    return SampleOrder(source_sizes=tuple(sizes), weights=tuple(weights), seed=seed, shuffle=True)


def step_prompts(
    order: SampleOrder, start: DataPosition, count: int
) -> tuple[tuple[int, ...], DataPosition]:
    """The `count` prompt ids from `start` on in `order` (epochs wrap) and the position after."""
    if count < 1:
        raise ValueError(f"a step takes at least one prompt, got count={count}")
    taken = list(itertools.islice(order.iter_from(start), count + 1))
    return tuple(prompt_id for _, prompt_id in taken[:count]), taken[count][0]
