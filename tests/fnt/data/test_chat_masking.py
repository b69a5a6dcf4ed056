"""How masks are found when the template marks them, rewrites reasoning, or cannot be masked."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from fnt.config import DataSourceConfig
from fnt.data import load_corpus
from fnt.data.chat import ChatMasking, has_generation_blocks, tokenize_conversation
from fnt.errors import DataError
from fnt.model.tokenizer import stop_token_ids
from tests.fnt.data.test_chat_templates import MULTI, decoded

# ChatML with the assistant text and its end-of-turn token marked for training.
GENERATION_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# DeepSeek-R1 style: the reasoning of every turn but the last is stripped from the history.
STRIP_EARLIER_REASONING = (
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Reasoning is never rendered, the last turn's included.
DROP_ALL_REASONING = STRIP_EARLIER_REASONING.replace(" and not loop.last", "")


@pytest.fixture(scope="module")
def chatml(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def masking(tokenizer, template=None, **options) -> ChatMasking:
    return ChatMasking(
        stop_ids=stop_token_ids(tokenizer, None, template), chat_template=template, **options
    )


def test_generation_blocks_give_the_tokenizers_assistant_mask(chatml):
    assert has_generation_blocks(GENERATION_TEMPLATE)
    assert not has_generation_blocks(chatml.chat_template)
    (all_turns,) = tokenize_conversation(MULTI, chatml, masking(chatml, GENERATION_TEMPLATE))
    assert decoded(chatml, [all_turns]) == [["4.<|im_end|>", "6.<|im_end|>"]]
    last = tokenize_conversation(MULTI, chatml, masking(chatml, GENERATION_TEMPLATE, turns="last"))
    assert decoded(chatml, last) == [["6.<|im_end|>"]]
    with pytest.raises(ValueError, match="cannot be honoured"):
        tokenize_conversation(
            MULTI, chatml, masking(chatml, GENERATION_TEMPLATE, roles=frozenset({"user"}))
        )


REASONED = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>r1</think>a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "<think>r2</think>a2"},
]


def test_stripped_earlier_reasoning_gives_each_turn_with_its_reasoning(chatml):
    samples = tokenize_conversation(REASONED, chatml, masking(chatml, STRIP_EARLIER_REASONING))
    assert decoded(chatml, samples) == [
        ["<think>r1</think>a1<|im_end|>"],
        ["<think>r2</think>a2<|im_end|>"],
    ]
    assert "assistant\na1<|im_end|>" in chatml.decode(samples[1][0])


def test_reasoning_the_template_never_renders_cannot_be_trained(chatml):
    with pytest.raises(ValueError, match="does not render this turn's reasoning"):
        tokenize_conversation(REASONED, chatml, masking(chatml, DROP_ALL_REASONING))
    samples = tokenize_conversation(
        REASONED, chatml, masking(chatml, DROP_ALL_REASONING, reasoning=False)
    )
    assert decoded(chatml, samples) == [["a1<|im_end|>", "a2<|im_end|>"]]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        # The content is changed on its way into the text, so its tokens are not the content's.
        (
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper + '<|im_end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
            "renders its content as 'A1'",
        ),
        # The answer is never shown.
        (
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
            "{% endfor %}",
            "does not render its content",
        ),
        # The history is rendered differently from the prompt and the turn cannot be placed.
        (
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}",
            "does not continue its generation prompt",
        ),
    ],
)
def test_a_chat_no_method_can_mask_is_an_error(chatml, template, message):
    chat = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    with pytest.raises(ValueError, match=message):
        tokenize_conversation(chat, chatml, masking(chatml, template))


def test_an_unmaskable_chat_names_its_file_and_line(chatml, tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    # Drops the answer "b", so the second chat's answer is nowhere in its rendering.
    template = (
        "{% for m in messages %}{{ m['role'] + ':' }}"
        "{% if m['content'] != 'b' %}{{ m['content'] }}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )

    source = DataSourceConfig(path=str(path))
    with pytest.raises(DataError, match=rf"{path}, line 2: messages\[1\]: .*cannot be located"):
        load_corpus(
            [source], chatml, seq_len=64, overlong="truncate", masking=masking(chatml, template)
        )
