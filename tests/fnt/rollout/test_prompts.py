"""Prompt records, rendering, loading errors, and the prompt order (determinism, resume, shares)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.batch import DataPosition
from fnt.errors import DataError
from fnt.rollout import (
    load_prompts,
    prompt_messages,
    prompt_order,
    render_prompt,
    step_prompts,
)


def test_a_prompt_record_is_one_user_message_and_messages_pass_through():
    assert prompt_messages({"prompt": "hi", "answer": "x"}) == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_messages({"messages": chat}) == chat


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "a", "messages": []}, "exactly one of"),
        ({"answer": "a"}, "exactly one of"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "string 'content'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "last message",
        ),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_records_say_what_is_wrong(record, message):
    with pytest.raises(ValueError, match=message):
        prompt_messages(record)


def test_prompts_render_with_the_generation_prompt_and_keep_every_field(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    path.write_text(
        json.dumps({"prompt": "olleh", "answer": "hello"})
        + "\n\n"
        + json.dumps({"messages": chat, "k": 1})
        + "\n"
    )
    first, second = load_prompts(path, tokenizer)
    assert (
        tokenizer.decode(first.token_ids)
        == "<|im_start|>user\nolleh<|im_end|>\n<|im_start|>assistant\n"
    )
    assert first.record == {"prompt": "olleh", "answer": "hello"} and first.line == 1
    assert list(second.token_ids) == render_prompt(chat, tokenizer)
    assert second.record["k"] == 1 and second.line == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\n\n{"prompt": \n', r"p\.jsonl, line 3: "),
        ('{"prompt": "a"}\n{"completion": "b"}\n', r"p\.jsonl, line 2: .*exactly one of"),
        ("\n\n", r"p\.jsonl: the file is empty"),
    ],
)
def test_malformed_prompt_files_name_the_file_and_line(tokenizer, tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        load_prompts(path, tokenizer)


def test_a_missing_prompts_file_is_named(tokenizer, tmp_path):
    with pytest.raises(DataError, match="prompts file .*nope.jsonl: cannot read it"):
        load_prompts(tmp_path / "nope.jsonl", tokenizer)


def run_steps(order, start: DataPosition, count: int, steps: int):
    ids, position = [], start
    for _ in range(steps):
        step_ids, position = step_prompts(order, position, count)
        ids.append(step_ids)
    return ids, position


@settings(max_examples=60, deadline=None)
@given(
    num_prompts=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    count=st.integers(1, 9),
    k=st.integers(0, 4),
    n=st.integers(1, 4),
)
def test_resuming_the_prompt_order_continues_exactly(num_prompts, seed, count, k, n):
    order = prompt_order(num_prompts, seed)
    straight, end = run_steps(order, DataPosition(), count, k + n)
    first, middle = run_steps(prompt_order(num_prompts, seed), DataPosition(), count, k)
    rest, resumed_end = run_steps(prompt_order(num_prompts, seed), middle, count, n)
    assert first + rest == straight
    assert resumed_end == end
    consumed = (k + n) * count
    assert (end.epoch, end.cursor) == divmod(consumed, num_prompts)


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 12), seed=st.integers(0, 2**31), epochs=st.integers(1, 3))
def test_every_epoch_shows_every_prompt_once(num_prompts, seed, epochs):
    ids, _ = step_prompts(prompt_order(num_prompts, seed), DataPosition(), num_prompts * epochs)
    for e in range(epochs):
        assert sorted(ids[e * num_prompts : (e + 1) * num_prompts]) == list(range(num_prompts))


def test_the_order_depends_on_the_seed_and_changes_between_epochs():
    order = prompt_order(20, seed=0)
    epoch0, position = step_prompts(order, DataPosition(), 20)
    epoch1, _ = step_prompts(order, position, 20)
    other, _ = step_prompts(prompt_order(20, seed=1), DataPosition(), 20)
    assert position == DataPosition(1, 0)
    assert epoch0 != epoch1 and epoch0 != other
