"""Reading JSONL sources: errors name file and line; over-long and loss-less samples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fnt.config import DataSourceConfig
from fnt.data import DataError, SampleFate, load_corpus

GOOD = json.dumps({"prompt": "p", "completion": "c"})


def source(path: Path, name: str = "") -> DataSourceConfig:
    return DataSourceConfig(path=str(path), name=name)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ("{not json", "Expecting property name"),
        (json.dumps({"prompt": "p"}), "needs key 'completion'"),
        (json.dumps({"prompt": 3, "completion": "c"}), "'prompt' must be a string"),
        (json.dumps({"messages": [{"role": "user", "content": 1}]}), "needs a string 'content'"),
        (json.dumps([1, 2]), "expected a JSON object"),
        (json.dumps("text"), "expected a JSON object"),
    ],
)
def test_a_malformed_line_names_the_file_and_its_1_based_line(
    tmp_path, tokenizer, bad_line, reason
):
    path = write(tmp_path / "train.jsonl", [GOOD, "", GOOD, bad_line, GOOD])
    with pytest.raises(DataError, match=re.escape(f"{path}, line 4: ") + ".*" + re.escape(reason)):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")


def test_invalid_utf8_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: ")):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_file_names_the_file(tmp_path, tokenizer, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=re.escape(f"{path}: the file is empty")):
        load_corpus(
            [source(write(tmp_path / "ok.jsonl", [GOOD])), source(path)],
            tokenizer,
            seq_len=64,
            overlong="truncate",
        )


def test_a_missing_file_names_the_file(tmp_path, tokenizer):
    with pytest.raises(DataError, match="data source .*missing.jsonl: cannot read it"):
        load_corpus(
            [source(tmp_path / "missing.jsonl")], tokenizer, seq_len=64, overlong="truncate"
        )


def overlong_file(tmp_path: Path) -> Path:
    """Line 1 fits 64 tokens; lines 2 and 3 do not, 2 with its answer late, 3 with it early."""
    return write(
        tmp_path / "mixed.jsonl",
        [
            GOOD,
            json.dumps({"prompt": "x" * 100, "completion": "late"}),
            json.dumps({"prompt": "p", "completion": "y" * 100}),
        ],
    )


def test_truncate_keeps_the_first_seq_len_tokens_and_counts_samples_it_empties_as_over_long(
    tmp_path, tokenizer
):
    corpus = load_corpus(
        [source(overlong_file(tmp_path))], tokenizer, seq_len=64, overlong="truncate"
    )
    assert corpus.fates == (SampleFate.KEPT, SampleFate.DROPPED_OVERLONG, SampleFate.TRUNCATED)
    assert [corpus.length(i) for i in range(3)] == [corpus.length(0), 0, 64]
    ids, targets = corpus.tokens(2)
    assert tokenizer.decode(ids).startswith(
        "<|im_start|>user\np<|im_end|>\n<|im_start|>assistant\nyyy"
    )
    assert tokenizer.decode(ids[targets]) == "y" * int(targets.sum())


def test_drop_drops_every_over_long_sample(tmp_path, tokenizer):
    corpus = load_corpus([source(overlong_file(tmp_path))], tokenizer, seq_len=64, overlong="drop")
    assert corpus.fates == (
        SampleFate.KEPT,
        SampleFate.DROPPED_OVERLONG,
        SampleFate.DROPPED_OVERLONG,
    )
    assert [corpus.length(i) for i in (1, 2)] == [0, 0]


def test_error_names_the_file_and_line_of_the_first_over_long_sample(tmp_path, tokenizer):
    path = overlong_file(tmp_path)
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: sample has") + ".*seq_len=64"):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="error")


def test_auto_drops_an_over_long_chat_and_truncates_an_over_long_prompt_completion(
    tmp_path, tokenizer
):
    chat = {
        "messages": [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "a"}]
    }
    pair = {"prompt": "p", "completion": "y" * 100}
    path = write(tmp_path / "both.jsonl", [GOOD, json.dumps(chat), json.dumps(pair)])
    corpus = load_corpus([source(path)], tokenizer, seq_len=64, overlong="auto")
    assert corpus.fates == (SampleFate.KEPT, SampleFate.DROPPED_OVERLONG, SampleFate.TRUNCATED)


def test_chats_truncated_to_nothing_are_counted_as_over_long_in_the_error(tmp_path, tokenizer):
    """The issue's message said "(0 over-long, 168 without target tokens)" when every chat was
    over-long and truncation had cut off every answer."""
    long_prompt = json.dumps({"prompt": "x" * 100, "completion": "c"})
    path = write(tmp_path / "long.jsonl", [long_prompt] * 3)
    with pytest.raises(DataError, match=re.escape("(3 over-long, 0 without target tokens)")):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")


def test_a_source_without_any_usable_sample_is_an_error(tmp_path, tokenizer):
    path = write(tmp_path / "long.jsonl", [json.dumps({"prompt": "x" * 100, "completion": "c"})])
    with pytest.raises(
        DataError, match=re.escape(f"{path}: no sample is usable") + ".*1 over-long"
    ):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="drop")


def test_sources_are_named_by_file_stem_unless_named_and_names_must_be_unique(tmp_path, tokenizer):
    first = write(tmp_path / "alpha.jsonl", [GOOD])
    second = write(tmp_path / "beta.jsonl", [GOOD, GOOD])
    corpus = load_corpus(
        [source(first), source(second, "b")], tokenizer, seq_len=64, overlong="truncate"
    )
    assert corpus.source_names == ("alpha", "b")
    assert corpus.source_sizes == (1, 2)
    with pytest.raises(ValueError, match="unique.*'alpha'"):
        load_corpus(
            [source(first), source(second, "alpha")], tokenizer, seq_len=64, overlong="truncate"
        )


def test_an_unknown_overlong_policy_is_rejected_before_reading(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="data.overlong must be one of"):
        load_corpus([source(tmp_path / "missing.jsonl")], tokenizer, seq_len=64, overlong="wrap")


def chat(*roles: str, content: object = "x") -> str:
    return json.dumps({"messages": [{"role": role, "content": content} for role in roles]})


def test_an_unknown_role_is_a_located_error(tmp_path, tokenizer):
    """The issue: a misspelled role ("usr") trained silently."""
    path = write(tmp_path / "train.jsonl", [GOOD, chat("usr", "assistant")])
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: messages[0] has role 'usr'")):
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")


def test_bad_chats_are_listed_first_few_then_counted(tmp_path, tokenizer):
    bad = [chat("usr", "assistant"), chat("user", "assistant", content=3)] * 3
    path = write(tmp_path / "train.jsonl", [GOOD, *bad])
    with pytest.raises(DataError) as caught:
        load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"{path}: 6 bad records (data.on_bad_sample='auto'")
    assert lines[1:] == [
        f"  {path}, line 2: messages[0] has role 'usr', which the chat template does not render "
        "(known roles: assistant, system, tool, user)",
        f"  {path}, line 3: messages[0] needs a string 'content'",
        f"  {path}, line 4: messages[0] has role 'usr', which the chat template does not render "
        "(known roles: assistant, system, tool, user)",
        "  ... and 3 more",
    ]


def test_a_chat_without_a_trained_turn_is_skipped_with_a_located_note(tmp_path, tokenizer):
    path = write(tmp_path / "noassist.jsonl", [GOOD, chat("system", "user"), GOOD])
    corpus = load_corpus([source(path)], tokenizer, seq_len=64, overlong="truncate")
    assert corpus.fates == (SampleFate.KEPT, SampleFate.DROPPED_NO_LOSS, SampleFate.KEPT)
    assert corpus.notes == (
        f"{path}: 1 chats left out (data.on_bad_sample='auto'): {path}, line 2: no message of a "
        "trained role (assistant; data.loss_mask)",
    )
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: no message of a trained")):
        load_corpus(
            [source(path)], tokenizer, seq_len=64, overlong="truncate", on_bad_sample="error"
        )


def test_skip_leaves_bad_chats_out_and_says_where(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", [GOOD, chat("usr", "assistant"), GOOD])
    corpus = load_corpus(
        [source(path)], tokenizer, seq_len=64, overlong="truncate", on_bad_sample="skip"
    )
    assert corpus.fates == (SampleFate.KEPT, SampleFate.DROPPED_BAD, SampleFate.KEPT)
    assert f"{path}, line 2: messages[0] has role 'usr'" in corpus.notes[0]


def test_a_role_the_template_names_is_known(tmp_path, tokenizer):
    from fnt.data.chat import ChatMasking, template_roles

    template = (
        "{% for m in messages %}{% if m.role == 'ipython' %}<tool>{{ m.content }}{% else %}"
        "<|im_start|>{{ m['role'] }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert template_roles(template) == {"system", "user", "assistant", "tool", "ipython"}
    assert "developer" in template_roles("{% if message['role'] in ['developer', 'system'] %}")
    path = write(tmp_path / "train.jsonl", [chat("user", "ipython", "assistant")])
    masking = ChatMasking(stop_ids=frozenset({tokenizer.eos_token_id}), chat_template=template)
    corpus = load_corpus(
        [source(path)], tokenizer, seq_len=64, overlong="truncate", masking=masking
    )
    assert corpus.fates == (SampleFate.KEPT,)
