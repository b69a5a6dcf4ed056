"""The record forms TRL reads (issue 45.7): `text` rows, ShareGPT `conversations`, contents as
lists of text parts; and an empty assistant turn's located note (issue 45.5)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from fnt.config import DataSourceConfig
from fnt.data import DataError, SampleFate, load_corpus
from fnt.data.cache import DataCache
from fnt.data.chat import (
    SHAREGPT_ROLES,
    ChatMasking,
    empty_turns,
    joined_text_parts,
    read_record,
)
from fnt.data.load import chat_record

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "2+2?"},
    {"from": "gpt", "value": "4"},
]


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def corpus(path: Path, tokenizer, **options):
    options = {"seq_len": 128, "overlong": "auto", **options}
    return load_corpus([DataSourceConfig(path=str(path))], tokenizer, **options)


def samples(corpus) -> list[tuple[list[int], list[bool]]]:
    out = []
    for i in range(corpus.num_samples):
        ids, targets = corpus.tokens(i)
        out.append((ids.tolist(), targets.tolist()))
    return out


# ---------------------------------------------------------------------------------------------
# text


def test_a_text_row_trains_every_token_after_the_first_with_the_eos_appended(tmp_path, tokenizer):
    text = "Plain text, as a base model reads it."
    got = corpus(write(tmp_path / "lm.jsonl", [{"text": text, "id": 3}]), tokenizer)
    [(ids, targets)] = samples(got)
    # As TRL's plain-text SFT: the text and the eos, tokenized with the tokenizer's own special
    # tokens (the tiny tokenizer adds none), no chat template.
    assert ids == tokenizer(text + tokenizer.eos_token)["input_ids"]
    assert "<|im_start|>" not in tokenizer.decode(ids)
    assert targets == [False] + [True] * (len(ids) - 1)
    assert got.fates == (SampleFate.KEPT,) and got.notes == ()


def test_a_text_that_ends_with_the_eos_gets_no_second_one(tmp_path, tokenizer):
    text = "done" + tokenizer.eos_token
    [(ids, _)] = samples(corpus(write(tmp_path / "lm.jsonl", [{"text": text}]), tokenizer))
    assert ids == tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.eos_token_id) == 1


def test_a_tokenizers_bos_is_kept_as_it_adds_it(tmp_path, tokenizer):
    with_bos = copy.deepcopy(tokenizer)
    bos = with_bos.convert_tokens_to_ids("<|im_start|>")  # a stand-in bos, any special token
    # What a Llama tokenizer does: `tokenizer(text)` puts its bos first.
    real = type(with_bos).__call__

    def call(self, text, *args, add_special_tokens=True, **kwargs):
        out = real(self, text, *args, add_special_tokens=add_special_tokens, **kwargs)
        if add_special_tokens:
            out["input_ids"] = [bos, *out["input_ids"]]
        return out

    with_bos.__class__ = type("WithBos", (type(with_bos),), {"__call__": call})
    [(ids, targets)] = samples(corpus(write(tmp_path / "lm.jsonl", [{"text": "x"}]), with_bos))
    assert ids[0] == bos and ids[-1] == with_bos.eos_token_id
    assert targets == [False] + [True] * (len(ids) - 1)  # the bos is context, the rest trained


def test_an_overlong_text_is_truncated_under_auto_and_an_empty_one_left_out(tmp_path, tokenizer):
    path = write(tmp_path / "lm.jsonl", [{"text": "x" * 100}, {"text": " "}, {"text": "ok"}])
    got = corpus(path, tokenizer, seq_len=32)
    assert got.fates == (SampleFate.TRUNCATED, SampleFate.DROPPED_NO_LOSS, SampleFate.KEPT)
    assert got.length(0) == 32
    assert got.notes == (
        f"{path}: 1 chats left out (data.on_bad_sample='auto'): {path}, line 2: 'text' is empty",
    )
    assert corpus(path, tokenizer, seq_len=32, overlong="drop").fates[0] == (
        SampleFate.DROPPED_OVERLONG
    )


def test_text_needs_no_chat_template_and_a_chat_without_one_names_its_line(tmp_path, tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    masking = ChatMasking(stop_ids=frozenset({bare.eos_token_id}))
    path = write(tmp_path / "lm.jsonl", [{"text": "a"}, {"text": "b"}])
    assert corpus(path, bare, masking=masking).fates == (SampleFate.KEPT,) * 2
    mixed = write(tmp_path / "mixed.jsonl", [{"text": "a"}, {"messages": CHAT[1:]}])
    with pytest.raises(DataError) as caught:
        corpus(mixed, bare, masking=masking)
    assert str(caught.value) == (
        f"{mixed}, line 2: a messages record is rendered with the chat template, and the "
        "tokenizer has none: set data.chat_template (a template file or its text)"
    )


def test_loss_mask_settings_do_not_change_a_text_rows_samples(tmp_path, tokenizer):
    path = write(tmp_path / "lm.jsonl", [{"text": "some words"}])
    plain = samples(corpus(path, tokenizer))
    masking = ChatMasking(
        roles=frozenset({"user"}), turns="last", stop_ids=frozenset({tokenizer.eos_token_id})
    )
    assert samples(corpus(path, tokenizer, masking=masking)) == plain


# ---------------------------------------------------------------------------------------------
# ShareGPT conversations


def test_sharegpt_conversations_train_as_the_same_messages(tmp_path, tokenizer):
    messages = corpus(write(tmp_path / "m.jsonl", [{"messages": CHAT}]), tokenizer)
    conversations = corpus(write(tmp_path / "c.jsonl", [{"conversations": SHAREGPT}]), tokenizer)
    # from/value under the messages column, role/content under conversations: the same chat.
    in_messages = corpus(write(tmp_path / "mc.jsonl", [{"messages": SHAREGPT}]), tokenizer)
    roles = corpus(write(tmp_path / "cm.jsonl", [{"conversations": CHAT}]), tokenizer)
    assert samples(conversations) == samples(messages) == samples(in_messages) == samples(roles)
    assert sum(samples(conversations)[0][1]) == 2  # "4" and its end token


@pytest.mark.parametrize(
    ("speaker", "role"),
    [
        ("human", "user"),
        ("user", "user"),
        ("Human", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("model", "assistant"),
        ("GPT", "assistant"),
        ("system", "system"),
        ("tool", "tool"),
        ("function", "tool"),
        ("observation", "tool"),
    ],
)
def test_each_sharegpt_speaker_becomes_its_role(speaker, role):
    # Other keys of a message (Axolotl's `weight`, say) pass through to the template.
    turns = [{"from": "human", "value": "q"}, {"from": speaker, "value": "v", "weight": 1}]
    read = read_record({"conversations": turns})
    assert read.form == "conversations"
    assert read.messages[-1] == {"role": role, "content": "v", "weight": 1}
    assert read.speakers[-1] == speaker
    assert SHAREGPT_ROLES[speaker.lower()] == role


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            {"value": "hi"},
            "conversations[1] needs a string 'from' (ShareGPT's speaker: human, gpt, system...) "
            "or a 'role'",
        ),
        (
            {"from": "narrator", "value": "hi"},
            "conversations[1] has 'from' 'narrator', which is no role fnt reads "
            "(human/user -> user, gpt/assistant/model -> assistant, system -> system, "
            "tool/function/observation -> tool); write the message with a 'role' the chat "
            "template renders instead",
        ),
        ({"from": "gpt"}, "conversations[1] needs a string 'value'"),
        ({"from": "gpt", "value": 4}, "conversations[1] needs a string 'value'"),
        ("hi", "conversations[1] must be an object, got str"),
        (
            {"from": "gpt", "value": [{"type": "image", "image": "x.png"}]},
            "conversations[1].value[0] is a part of type 'image': fnt trains on text only",
        ),
    ],
)
def test_a_bad_sharegpt_message_is_one_located_line(tmp_path, tokenizer, bad, reason):
    good = {"conversations": SHAREGPT}
    path = write(tmp_path / "c.jsonl", [good, {"conversations": [SHAREGPT[1], bad]}, good])
    with pytest.raises(DataError) as caught:
        corpus(path, tokenizer)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"{path}: 1 bad records")
    assert lines[1].startswith(f"  {path}, line 2: {reason}")
    assert len(lines) == 2


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": CHAT, "conversations": SHAREGPT}, "'messages' or 'conversations', not both"),
        ({"conversations": SHAREGPT, "prompt": "p"}, "'conversations' or 'prompt'/'completion'"),
        ({"conversations": []}, "'conversations' must be a non-empty list"),
        ({"conversations": SHAREGPT[2:]}, "conversations[0] must not be an assistant message"),
        ({"text": ["a"]}, "'text' must be a string, got list"),
        (
            {"txt": "a"},
            "expected keys 'prompt' and 'completion', or 'messages', or 'conversations', or "
            "'text'; got keys ['txt']",
        ),
    ],
)
def test_read_record_names_what_is_wrong(record, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        read_record(record)


def test_a_chat_is_read_before_text_and_two_chats_are_an_error():
    source = DataSourceConfig()
    record = {"messages": CHAT, "text": "rendered", "id": 1}
    assert chat_record(record, source) == {"messages": CHAT, "id": 1}
    assert read_record(chat_record(record, source)).form == "messages"
    assert chat_record({"conversations": SHAREGPT, "text": "t"}, source) == {
        "conversations": SHAREGPT
    }
    assert chat_record({"text": "t", "id": 1}, source) == {"text": "t", "id": 1}
    with pytest.raises(ValueError, match=re.escape("both 'conversations' (a ShareGPT chat)")):
        chat_record({"conversations": SHAREGPT, "messages": CHAT}, source)
    with pytest.raises(ValueError, match=re.escape("both 'conversations' (a ShareGPT chat)")):
        chat_record({"conversations": SHAREGPT, "prompt": "p", "completion": "c"}, source)
    # A column setting that names one of these keys reads it as that column.
    as_prompt = DataSourceConfig(prompt_column="text", completion_column="answer")
    assert chat_record({"text": "q", "answer": "a"}, as_prompt) == {
        "prompt": "q",
        "completion": "a",
    }
    as_messages = DataSourceConfig(messages_column="conversations")
    assert chat_record({"conversations": SHAREGPT}, as_messages) == {"messages": SHAREGPT}
    no_messages = DataSourceConfig(messages_column="")
    assert chat_record({"conversations": SHAREGPT, "messages": 0}, no_messages) == {
        "conversations": SHAREGPT
    }


# ---------------------------------------------------------------------------------------------
# contents as lists of parts


def test_text_parts_are_joined_with_newlines_and_train_as_the_joined_string(tmp_path, tokenizer):
    parts = [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Be exact."}]
    record = {"messages": [{"role": "user", "content": parts}, CHAT[2]]}
    read = read_record(record)
    assert read.messages[0]["content"] == "2+2?\nBe exact." and read.joined_parts
    joined = {"messages": [{"role": "user", "content": "2+2?\nBe exact."}, CHAT[2]]}
    assert samples(corpus(write(tmp_path / "p.jsonl", [record]), tokenizer)) == samples(
        corpus(write(tmp_path / "s.jsonl", [joined]), tokenizer)
    )
    assert joined_text_parts([], "x") == ""


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:..."}},
            "messages[1].content[1] is a part of type 'image_url': fnt trains on text only "
            '(parts {"type": "text", "text": ...})',
        ),
        ({"type": "text"}, "messages[1].content[1] needs a string 'text'"),
        (
            {"text": "no type"},
            """messages[1].content[1] needs a string 'type' ("text" and a 'text')""",
        ),
        ("just text", "messages[1].content[1] must be an object, got str"),
    ],
)
def test_a_part_that_is_not_text_is_one_located_line(tmp_path, tokenizer, part, reason):
    content = [{"type": "text", "text": "4"}, part]
    record = {"messages": [CHAT[1], {"role": "assistant", "content": content}]}
    path = write(tmp_path / "p.jsonl", [{"messages": CHAT}, record])
    with pytest.raises(DataError) as caught:
        corpus(path, tokenizer)
    assert str(caught.value).splitlines()[1] == f"  {path}, line 2: {reason}"


# ---------------------------------------------------------------------------------------------
# empty assistant turns


def test_an_empty_assistant_turn_is_kept_with_a_located_note(tmp_path, tokenizer):
    empty = {"messages": [*CHAT[:2], {"role": "assistant", "content": " "}]}
    path = write(tmp_path / "e.jsonl", [{"messages": CHAT}, empty, {"text": "t"}])
    got = corpus(path, tokenizer)
    assert got.fates == (SampleFate.KEPT,) * 3
    assert tokenizer.decode([i for i, t in zip(*samples(got)[1]) if t]) == " <|im_end|>"
    assert got.notes == (
        f"{path}: 1 chats have an empty assistant turn (no text but white space), which teaches "
        "the model to answer nothing: "
        f"{path}, line 2: messages[2]",
    )


def test_the_note_lists_the_first_few_and_counts_the_rest(tmp_path, tokenizer):
    two = {
        "messages": [
            CHAT[1],
            {"role": "assistant", "content": ""},
            CHAT[1],
            {"role": "assistant", "content": ""},
        ]
    }
    path = write(tmp_path / "e.jsonl", [two] * 5)
    [note] = corpus(path, tokenizer).notes
    assert note == (
        f"{path}: 5 chats have an empty assistant turn (no text but white space), which teaches "
        "the model to answer nothing: "
        f"{path}, line 1: messages[1], messages[3]; {path}, line 2: messages[1], messages[3]; "
        f"{path}, line 3: messages[1], messages[3]; and 2 more"
    )


def test_the_note_comes_back_from_the_cache(tmp_path, tokenizer):
    path = write(tmp_path / "e.jsonl", [{"prompt": "p", "completion": ""}])
    cache = DataCache(tmp_path / "cache")
    first = corpus(path, tokenizer, cache=cache)
    second = corpus(path, tokenizer, cache=cache)
    assert second.cache_entries != ("",)  # read from the entry
    assert first.notes == second.notes and "line 1: messages[1]" in first.notes[0]


def test_which_assistant_turns_count_as_empty():
    masking = ChatMasking()
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    thinking = {"role": "assistant", "content": "<think>hm</think>"}
    empty = {"role": "assistant", "content": ""}
    chat = [CHAT[1], empty, CHAT[1], call, CHAT[1], thinking]
    assert empty_turns(chat, masking) == [1]  # a tool call, and trained reasoning, are targets
    no_reasoning = ChatMasking(reasoning=False)
    assert empty_turns(chat, no_reasoning) == [1, 5]
    assert empty_turns(chat, ChatMasking(turns="last")) == []  # turn 1 is not trained
    assert empty_turns([CHAT[1], empty], ChatMasking(roles=frozenset({"user"}))) == []
