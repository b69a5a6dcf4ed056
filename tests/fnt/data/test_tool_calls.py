"""Tool calls and the ends of chats: a template that drops `tools` or `tool_calls` is an error
naming the file and line; OpenAI's null content on a tool-call turn is accepted; a chat's
trailing untrained turns are cut, with a counted note."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fnt.config import DataSourceConfig
from fnt.data import DataError, SampleFate, load_corpus
from fnt.data.chat import unrendered_tool_parts, without_untrained_tail
from tests.chat_fixtures import fixture_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOL_CHAT = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "rain, 4 C"},
        {"role": "assistant", "content": "Rain and 4 C."},
    ],
}


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def load(path: Path, tokenizer):
    # Byte-level tokens, and Qwen3's tool preamble: a long sequence.
    return load_corpus([DataSourceConfig(path=str(path))], tokenizer, seq_len=4096, overlong="drop")


def test_a_template_that_does_not_render_tool_calls_is_an_error_naming_file_and_line(
    tmp_path, tokenizer
):
    """The tiny model's ChatML template renders neither `tools` nor `tool_calls`: the turn
    would train as an empty answer where the call was."""
    plain = {"prompt": "p", "completion": "c"}
    path = write(tmp_path / "tools.jsonl", [plain, TOOL_CHAT])
    expected = (
        f"{path}, line 2: the chat template does not render messages[1].tool_calls "
        "('get_weather'), tools ('get_weather')"
    )
    with pytest.raises(DataError, match=re.escape(expected)):
        load(path, tokenizer)


def test_a_template_that_renders_tools_trains_the_call_with_null_content(tiny_model_dir, tmp_path):
    qwen3 = fixture_tokenizer(tiny_model_dir, "qwen3")
    corpus = load(write(tmp_path / "tools.jsonl", [TOOL_CHAT]), qwen3)
    assert all(fate == SampleFate.KEPT for fate in corpus.fates)
    # Qwen3 rewrites history: one sample per assistant turn, the call's turn first.
    trained = "".join(
        qwen3.decode(ids[targets]) for ids, targets in map(corpus.tokens, range(corpus.num_samples))
    )
    assert "get_weather" in trained and "Oslo" in trained and "Rain and 4 C." in trained


def test_null_content_is_accepted_only_on_a_turn_with_tool_calls(tmp_path, tokenizer):
    record = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    }
    path = write(tmp_path / "null.jsonl", [record])
    with pytest.raises(DataError, match=re.escape(f"{path}, line 1: messages[1] needs a string")):
        load(path, tokenizer)


def test_a_trailing_user_turn_is_cut_and_counted(tmp_path, tokenizer):
    chat = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "never answered"},
        ]
    }
    path = write(tmp_path / "tail.jsonl", [{"prompt": "p", "completion": "c"}, chat, chat])
    corpus = load(path, tokenizer)
    assert corpus.notes == (
        f"{path}: 2 chats end with turns that data.loss_mask does not train (the first at "
        f"{path}, line 2); those turns were left out",
    )
    ids, _ = corpus.tokens(1)
    assert "never answered" not in tokenizer.decode(ids)


def test_without_untrained_tail():
    messages = [{"role": r, "content": r} for r in ("system", "user", "assistant", "user", "tool")]
    assert without_untrained_tail(messages, frozenset({"assistant"})) == (messages[:3], 2)
    assert without_untrained_tail(messages, frozenset({"assistant", "user"})) == (messages[:4], 1)
    assert without_untrained_tail(messages[:3], frozenset({"assistant"})) == (messages[:3], 0)


def test_unrendered_tool_parts_checks_function_names():
    messages = [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    assert unrendered_tool_parts(messages, [WEATHER_TOOL], "get_weather(city=Oslo)") == []
    assert unrendered_tool_parts(messages, None, "no call here") == [
        "messages[0].tool_calls ('get_weather')"
    ]
