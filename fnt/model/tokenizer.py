"""Tokenizer loading, the pad-token rule, stop tokens and chat templates. Side effects:
`load_tokenizer` reads the model directory, `stop_token_ids` its generation_config.json,
`chat_template_text` a template file; `pad_token_id` is pure. (The chat-masking settings built
from these are fnt.data.chat.chat_masking.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from fnt.errors import ConfigError

# A chat whose assistant content is easy to find in the rendering: the first special token after
# it is the template's end-of-turn token.
_SENTINEL_ANSWER = "\x02fnt-sentinel-answer\x02"
_SENTINEL_CHAT = [
    {"role": "user", "content": "\x01fnt-sentinel-question\x01"},
    {"role": "assistant", "content": _SENTINEL_ANSWER},
]


def load_tokenizer(model_name: str) -> Any:
    """The Hugging Face tokenizer stored with the model in `model_name` (a local directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_name)


def pad_token_id(tokenizer: Any) -> int:
    """The id rows are padded with: the pad token, else the eos token (padding never carries
    loss or attention, so any id works; eos is what most causal LMs without a pad token use)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise ValueError("the tokenizer has neither a pad token nor an eos token to pad rows with")


def stop_token_ids(
    tokenizer: Any, model_dir: str | Path | None, chat_template: str | None = None
) -> frozenset[int]:
    """The ids that end an assistant turn: the tokenizer's eos, the eos_token_id (an int or a
    list) of generation_config.json in `model_dir` when there is one, and the template's
    end-of-turn token (the first special token after the assistant's content in a rendered
    chat; `chat_template` overrides the tokenizer's). ValueError when there is none at all."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    ids |= _generation_config_eos(model_dir)
    end_of_turn = template_end_of_turn_id(tokenizer, chat_template)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    if not ids:
        raise ValueError("the tokenizer has no eos token and the model lists no stop token")
    return frozenset(ids)


def template_end_of_turn_id(tokenizer: Any, chat_template: str | None = None) -> int | None:
    """The first special token the template renders after an assistant turn's content, or None
    (no template, a template that cannot render a plain two-turn chat, or no special token)."""
    template = chat_template or tokenizer.chat_template
    if not template:
        return None
    try:
        text = tokenizer.apply_chat_template(
            _SENTINEL_CHAT, chat_template=template, tokenize=False, add_generation_prompt=False
        )
    except TemplateError:
        return None
    at = text.rfind(_SENTINEL_ANSWER)
    if at < 0:
        return None
    special = set(tokenizer.all_special_ids)
    after = tokenizer(text[at + len(_SENTINEL_ANSWER) :], add_special_tokens=False)["input_ids"]
    return next((i for i in after if i in special), None)


def _generation_config_eos(model_dir: str | Path | None) -> set[int]:
    if not model_dir:
        return set()
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if eos is None:
        return set()
    eos = [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) for i in eos):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return set(eos)


def chat_template_text(value: str) -> str | None:
    """The template that `data.chat_template` names: None when empty, the text of the file when
    it names one, else the value itself (a template string)."""
    if not value:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"'data.chat_template' = {value!r}: not a template (it has no {{{{ or {{%) and not a "
            f"readable file: {e}"
        ) from e
