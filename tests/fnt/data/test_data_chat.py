"""Records to token ids and loss masks through the tiny model's ChatML template."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from fnt.data import conversation_from_record, tokenize_conversation
from fnt.data.chat import ChatMasking
from fnt.model.tokenizer import stop_token_ids

contents = st.text(max_size=20)


def one_sample(messages, tokenizer):
    """The single sample a prefix-stable template gives, with the default masking."""
    masking = ChatMasking(stop_ids=stop_token_ids(tokenizer, None))
    (sample,) = tokenize_conversation(messages, tokenizer, masking)
    return sample


@st.composite
def conversations(draw) -> list[dict]:
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(contents)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(contents)})
        for _ in range(draw(st.integers(1, 2))):  # sometimes two assistant turns in a row
            messages.append({"role": "assistant", "content": draw(contents)})
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(contents)})
    return messages


def target_runs(ids: list[int], targets: list[bool]) -> list[list[int]]:
    """Maximal stretches of consecutive target tokens."""
    runs: list[list[int]] = []
    for i, (token, is_target) in enumerate(zip(ids, targets)):
        if is_target:
            if i == 0 or not targets[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


EVERY_MARKER = "\x0f\x0e\x07\x06\x05\x04\x03\x02\x01"  # fnt.data.chat's marker characters


@settings(max_examples=60, deadline=None)
@given(messages=conversations())
# Contents that hold every character fnt marks a content with (found by this test once).
@example(messages=[{"role": "user", "content": ""}, {"role": "assistant", "content": EVERY_MARKER}])
@example(
    messages=[
        {"role": "user", "content": EVERY_MARKER},
        {"role": "assistant", "content": f" \x01{EVERY_MARKER}\x02 "},
    ]
)
def test_targets_are_each_assistant_turn_through_its_eos(tokenizer, messages):
    ids, targets = one_sample(messages, tokenizer)
    decoded_runs = [tokenizer.decode(run) for run in target_runs(ids, targets)]
    assert decoded_runs == [
        m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"
    ]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_prompt_completion_is_a_user_assistant_chat_and_the_newline_after_eos_is_no_target(
    tokenizer,
):
    messages = conversation_from_record({"prompt": "hi", "completion": "yo", "id": 7})
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids, targets = one_sample(messages, tokenizer)
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    assert ids[-2:] == [tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[0]]
    assert targets[-3:] == [True, True, False]  # "o", <|im_end|>, "\n"
    assert sum(targets) == 3


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (["prompt"], "expected a JSON object"),
        ({"prompt": "a"}, "needs key 'completion'"),
        ({"completion": "a"}, "needs key 'prompt'"),
        ({"prompt": 1, "completion": "b"}, "'prompt' must be a string"),
        ({"prompt": "a", "completion": None}, "'completion' must be a string"),
        ({"txt": "a"}, "expected keys 'prompt' and 'completion', or 'messages', or"),
        ({"messages": [], "prompt": "a"}, "not both"),
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "user"}]}, "messages[0] needs a string 'content'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
            "messages[1] needs a string 'role'",
        ),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "must not be an assistant"),
    ],
)
def test_bad_records_are_rejected_with_the_reason(record, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        conversation_from_record(record)


def test_a_template_that_rewrites_earlier_turns_gives_one_sample_per_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Like reasoning templates that hide earlier answers: an answer renders differently once
    # another turn follows it, so training it inside the whole chat would train a text the model
    # never produced. Each turn is a sample of its own, as the model met it.
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\n…<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    masking = ChatMasking(stop_ids=stop_token_ids(tokenizer, None))
    turns = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert len(tokenize_conversation(turns[:2], tokenizer, masking)) == 1
    samples = tokenize_conversation(turns, tokenizer, masking)
    assert [tokenizer.decode(ids) for ids, _ in samples] == [
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n",
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n…<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\na2<|im_end|>\n",
    ]
    assert [
        [tokenizer.decode(run) for run in target_runs(ids, targets)] for ids, targets in samples
    ] == [["a1<|im_end|>"], ["a2<|im_end|>"]]


def test_a_template_error_becomes_a_value_error(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenize_conversation(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            tokenizer,
            ChatMasking(),
        )
