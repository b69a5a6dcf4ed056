"""Turn one JSONL record into token ids and a loss mask via the chat template. Pure.

Record formats:
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a chat, rendered with the tokenizer's chat
  template. Extra keys in a message (e.g. `name`) are passed to the template unchanged.
- `{"prompt": ..., "completion": ...}`: rendered as the chat
  `[user: prompt, assistant: completion]`, so both formats go through the same template and look
  alike to the model.
Other top-level keys (e.g. `id`) are ignored.

Which tokens are targets: the assistant turns, from the first token after the assistant header
(what `add_generation_prompt=True` renders) through the tokenizer's eos token that closes the turn
(`<|im_end|>` in ChatML), so the model learns to stop. Tokens the template puts after that eos (the
newline in ChatML) are not targets: generation stops at eos, so the model never produces them. A
template whose assistant turn contains no eos token gets its whole assistant text as target.

How the mask is found, for any template: the conversation is rendered at each assistant
boundary (`messages[:i]` with the generation prompt, then `messages[:i+1]`) and each rendering must
extend the previous one. Templates that rewrite earlier turns (e.g. dropping earlier reasoning)
fail that check with an error rather than a silently wrong mask. The text between boundaries is
tokenized piece by piece, the way inference sees it: the prompt is tokenized as its own string and
the answer's tokens follow it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from jinja2 import TemplateError

Message = Mapping[str, Any]


def conversation_from_record(record: object) -> list[Message]:
    """The messages of one parsed JSONL record; ValueError says what is wrong with a bad record."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    has_chat = "messages" in record
    has_completion = "prompt" in record or "completion" in record
    if has_chat and has_completion:
        raise ValueError("a record has either 'messages' or 'prompt'/'completion', not both")
    if has_chat:
        return _checked_messages(record["messages"])
    if has_completion:
        for key in ("prompt", "completion"):
            if key not in record:
                raise ValueError(f"a prompt/completion record needs key {key!r}")
            if not isinstance(record[key], str):
                raise ValueError(f"{key!r} must be a string, got {type(record[key]).__name__}")
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    raise ValueError(
        f"expected keys 'prompt' and 'completion', or 'messages'; got keys {sorted(record)}"
    )


def check_message_list(messages: object) -> None:
    """ValueError unless `messages` is a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}] needs a string {key!r}")


def _checked_messages(messages: object) -> list[Message]:
    check_message_list(messages)
    if messages[0]["role"] == "assistant":
        # The template cannot render an empty prompt, so the assistant header could not be told
        # apart from the answer and would be trained on.
        raise ValueError("messages[0] must not be an assistant message")
    return messages


def tokenize_conversation(messages: Sequence[Message], tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is a training target."""
    pieces: list[tuple[str, bool]] = []  # (text, is an assistant answer)
    rendered = ""  # the text already split into pieces
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        _check_extends(rendered, prompt, f"messages[:{i}] with the generation prompt")
        answered = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        _check_extends(prompt, answered, f"messages[:{i + 1}]")
        pieces += [(prompt[len(rendered) :], False), (answered[len(prompt) :], True)]
        rendered = answered
    if messages[-1]["role"] != "assistant":
        whole = _render(tokenizer, messages, add_generation_prompt=False)
        _check_extends(rendered, whole, "the whole conversation")
        pieces.append((whole[len(rendered) :], False))

    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    targets: list[bool] = []
    for ids, (_, is_answer) in zip(encoded, pieces):
        input_ids += ids
        targets += _answer_targets(ids, tokenizer.eos_token_id) if is_answer else [False] * len(ids)
    return input_ids, targets


def _answer_targets(ids: list[int], eos_token_id: int | None) -> list[bool]:
    """Targets of an assistant answer: everything through its last eos token."""
    if eos_token_id not in ids:
        return [True] * len(ids)
    end = len(ids) - ids[::-1].index(eos_token_id)
    return [True] * end + [False] * (len(ids) - end)


def _render(tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e


def _check_extends(prefix: str, text: str, what: str) -> None:
    if not text.startswith(prefix):
        raise ValueError(
            f"the chat template is not prefix-stable: rendering {what} does not start with the "
            "rendering of the earlier turns, so the assistant tokens cannot be located. Use a "
            "template that renders earlier turns the same way whatever follows them."
        )
