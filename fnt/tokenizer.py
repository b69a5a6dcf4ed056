"""Tokenizer loading and the pad-token rule. Side effects: `load_tokenizer` reads the model
directory; `pad_token_id` is pure.
"""

from __future__ import annotations

from typing import Any


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
