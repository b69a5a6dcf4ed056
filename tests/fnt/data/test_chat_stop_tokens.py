"""Stop tokens: eos, generation_config.json's eos list and the template's end-of-turn token."""

from __future__ import annotations

import json

import pytest

from fnt.data.chat import ChatMasking, tokenize_conversation
from fnt.errors import ConfigError
from fnt.model.tokenizer import chat_template_text, stop_token_ids, template_end_of_turn_id
from tests.chat_fixtures import fixture_tokenizer
from tests.fnt.data.test_chat_templates import SINGLE, decoded

END_OF_TURN = {
    "qwen3": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "gemma2": "<end_of_turn>",
    "mistral": "</s>",
    "phi3": "<|end|>",
}


@pytest.mark.parametrize("family", sorted(END_OF_TURN))
def test_the_end_of_turn_token_is_the_first_special_token_after_the_answer(tiny_model_dir, family):
    tokenizer = fixture_tokenizer(tiny_model_dir, family)
    found = template_end_of_turn_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(found) == END_OF_TURN[family]


def llama3_base(tiny_model_dir):
    """The Llama 3 tokenizer as base models ship it: eos <|end_of_text|>, turns end <|eot_id|>."""
    tokenizer = fixture_tokenizer(tiny_model_dir, "llama3")
    tokenizer.add_special_tokens({"eos_token": "<|end_of_text|>"})
    return tokenizer


def test_the_stop_ids_are_the_union_of_eos_generation_config_and_end_of_turn(
    tiny_model_dir, tmp_path
):
    tokenizer = llama3_base(tiny_model_dir)
    ids = tokenizer.convert_tokens_to_ids
    assert stop_token_ids(tokenizer, None) == {ids("<|end_of_text|>"), ids("<|eot_id|>")}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids("<|end_of_text|>"), ids("<|eom_id|>")]})
    )
    assert stop_token_ids(tokenizer, tmp_path) == {
        ids("<|end_of_text|>"),
        ids("<|eot_id|>"),
        ids("<|eom_id|>"),
    }
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert 7 in stop_token_ids(tokenizer, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list"):
        stop_token_ids(tokenizer, tmp_path)


def test_a_turn_ends_at_the_end_of_turn_token_even_when_eos_differs(tiny_model_dir):
    llama = llama3_base(tiny_model_dir)
    samples = tokenize_conversation(
        SINGLE, llama, ChatMasking(stop_ids=stop_token_ids(llama, None))
    )
    assert decoded(llama, samples) == [["4.<|eot_id|>"]]
    # Phi-3.5 ends a turn with <|end|> and the chat with eos: with eos alone as the stop token, the
    # newline and eos the template appends would be trained as if the model wrote them.
    phi = fixture_tokenizer(tiny_model_dir, "phi3")
    union = tokenize_conversation(SINGLE, phi, ChatMasking(stop_ids=stop_token_ids(phi, None)))
    assert decoded(phi, union) == [["4.<|end|>"]]
    eos_only = tokenize_conversation(SINGLE, phi, ChatMasking(stop_ids={phi.eos_token_id}))
    assert decoded(phi, eos_only) == [["4.<|end|>\n<|endoftext|>"]]


def test_data_chat_template_is_a_template_or_a_file(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_template_text("") is None
    assert chat_template_text(template) == template
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template_text(str(tmp_path / "t.jinja")) == template
    with pytest.raises(ConfigError, match="data.chat_template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
