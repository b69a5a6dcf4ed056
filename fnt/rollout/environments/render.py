"""Tokens in, tokens out: the token ids of an episode's next turn. Pure (the tokenizer renders
and tokenizes).

The engine never re-tokenizes what the model sampled. After a model turn, the episode's tokens
are the context so far plus the turn's sampled ids; the environment's reply is appended as the
chat template's rendering of only the new messages (and the generation prompt), found as the
text the template writes after the model turn's content (`reply_ids`). So the context of every
turn is exactly the tokens earlier turns were sampled in, followed by new context.

Templates that rewrite history (Qwen3 drops the <think> block of an assistant turn once a new
user message follows; it writes an empty <think></think> into the last assistant turn only)
would render earlier turns differently in a full re-render. fnt keeps the sampled context: the
trajectory is one flat branch in which every turn's tokens stand exactly as they were sampled,
and every later turn was sampled after them, so training reproduces the sampling exactly; the
rewritten rendering is never used. (The other way, prime-rl's, splits the episode into several
branches that share the advantage; it trains each turn in the context a deployed model would
see, at the cost of re-running the shared prefix once per branch.)

The check: the template must end the model's turn with the same text whether or not messages
follow it (the closing text is a prefix of the reply's rendering); a template that does not is
an error naming the turn, as no token-exact continuation exists for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments.protocol import Message

# A private-use character pair no template writes, standing in for the model turn's content.
TURN_MARK = "\ue000fnt-turn\ue001"


def template_text(
    tokenizer,
    messages: Sequence[Message],
    tools: Optional[Sequence[Mapping[str, Any]]],
    generation_prompt: bool,
) -> str:
    """The chat template's text of the conversation (with `tools` when given)."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template, which rendering a turn needs")
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=generation_prompt,
        tokenize=False,
        **extra,
    )


def tokens_of(tokenizer, text: str) -> list[int]:
    # The template already wrote any special tokens it wants; the tokenizer must not add more.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def as_sampled(message: Message) -> Message:
    """A model turn as the plain text it was sampled as (its "text",
    fnt.rollout.environments.parsers), not its parsed parts: the rendering only needs the text
    after the last turn, and some templates refuse parsed tool calls (Llama 3's allow one per
    turn, Mistral's want 9-character ids)."""
    if message.get("role") == "assistant" and "text" in message:
        return {"role": "assistant", "content": message["text"]}
    return message


def reply_ids(
    tokenizer,
    messages: Sequence[Message],
    tools: Optional[Sequence[Mapping[str, Any]]],
    reply: Sequence[Message],
    turn_ids: Sequence[int],
) -> list[int]:
    """The token ids to append after the model turn `turn_ids` (the last of `messages`) so that
    the episode continues after `reply`: the template's text from the end of the turn's content
    through the reply's messages and the generation prompt. When the turn ended with the token
    that text begins with (its end-of-turn token), that token is not repeated."""
    marked = [*map(as_sampled, messages[:-1]), {"role": "assistant", "content": TURN_MARK}]
    closed = template_text(tokenizer, marked, tools, generation_prompt=False)
    full = template_text(tokenizer, [*marked, *reply], tools, generation_prompt=True)
    if closed.count(TURN_MARK) != 1 or full.count(TURN_MARK) != 1:
        raise ValueError("the chat template does not write an assistant turn's content verbatim")
    closing, tail = closed.split(TURN_MARK)[1], full.split(TURN_MARK)[1]
    if not tail.startswith(closing):
        raise ValueError(
            f"the chat template ends an assistant turn with {closing!r} when nothing follows "
            f"but with {tail[: len(closing) + 20]!r} before the reply: no token-exact "
            "continuation of the sampled turn exists"
        )
    ids = tokens_of(tokenizer, tail)
    if turn_ids and ids and ids[0] == turn_ids[-1]:
        ids = ids[1:]
    return ids
