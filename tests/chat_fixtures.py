"""Tokenizers for the real chat templates in tests/fixtures/chat_templates/<family>.json.

Each fixture holds a model family's published chat_template and special tokens (its `source` says
where from). A fixture tokenizer is the tiny model's byte-level tokenizer with those special
tokens added and that template set, so real templates render and tokenize offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
FAMILIES = tuple(sorted(path.stem for path in FIXTURES.glob("*.json")))


def load_fixture(family: str) -> dict:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def fixture_tokenizer(model_dir, family: str):
    """The tiny model's tokenizer (loaded from `model_dir`) dressed as `family`'s."""
    fixture = load_fixture(family)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": fixture["additional_special_tokens"]},
        replace_extra_special_tokens=False,
    )
    for role in ("bos", "eos", "pad"):
        token = fixture[f"{role}_token"]
        if token is not None:
            tokenizer.add_special_tokens({f"{role}_token": token})
        else:
            setattr(tokenizer, f"{role}_token", None)
    tokenizer.chat_template = fixture["chat_template"]
    return tokenizer
