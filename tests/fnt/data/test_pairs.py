"""Preference pairs: record formats, response-only masks, the overlong policy, the cache, and
packing both sides of a pair into one row as isolated documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fnt.data.pairs as pairs_module
from fnt.batch import DataPosition
from fnt.config import DataConfig, DataSourceConfig
from fnt.data.cache import DataCache
from fnt.data.corpus import SampleFate
from fnt.data.load import load_corpus
from fnt.data.pairs import (
    fit_pair,
    load_pair_corpus,
    load_pair_data,
    pack_pairs,
    pair_from_record,
    pair_masking,
    side_limits,
)
from fnt.errors import DataError

SOURCE = DataSourceConfig(path="x.jsonl")
TEXT = {"prompt": "count to 3", "chosen": "1 2 3", "rejected": "3 1"}
CHAT = {
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    "chosen": [{"role": "assistant", "content": "hello"}],
    "rejected": [{"role": "assistant", "content": "go away"}],
}


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_chat_messages_and_implicit_prompts_read_as_the_same_chats():
    text = pair_from_record(TEXT, SOURCE)
    assert text.prompt == [{"role": "user", "content": "count to 3"}] and not text.chat
    assert text.chosen == {"role": "assistant", "content": "1 2 3"}
    assert text.rejected == {"role": "assistant", "content": "3 1"}
    chat = pair_from_record(CHAT, SOURCE)
    assert chat.chat and chat.prompt == CHAT["prompt"]
    messages = pair_from_record({**CHAT, "messages": CHAT.pop("prompt")}, SOURCE)
    CHAT["prompt"] = messages.prompt
    assert messages == chat
    implicit = {
        "chosen": CHAT["prompt"] + CHAT["chosen"],
        "rejected": CHAT["prompt"] + CHAT["rejected"],
    }
    assert pair_from_record(implicit, SOURCE) == chat
    renamed = DataSourceConfig(
        path="x", prompt_column="q", chosen_column="good", rejected_column="bad"
    )
    assert pair_from_record({"q": "count to 3", "good": "1 2 3", "bad": "3 1"}, renamed) == text


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "p", "chosen": "a"}, "needs keys 'chosen' and 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "no prompt"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "must be a string or a list"),
        ({"prompt": "p", "chosen": ["a", "b"], "rejected": "b"}, "one assistant message"),
        ({"prompt": "p", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "assistant"),
        (
            {"prompt": [{"role": "assistant", "content": "a"}], "chosen": "a", "rejected": "b"},
            "must not end with an assistant message",
        ),
        ({"prompt": [], "chosen": "a", "rejected": "b"}, "non-empty"),
    ],
)
def test_a_bad_pair_says_what_is_wrong(record, message):
    with pytest.raises(ValueError, match=message):
        pair_from_record(record, SOURCE)


def test_a_bad_line_is_named_with_its_file_and_line(tmp_path, tokenizer):
    path = write(tmp_path / "pairs.jsonl", [TEXT, TEXT, {"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=r"pairs.jsonl, line 3: a preference pair needs keys"):
        corpus_of(path, tokenizer)


def corpus_of(path, tokenizer, cache=None, seq_len=128, overlong="auto"):
    return load_pair_corpus(
        [DataSourceConfig(path=str(path))],
        tokenizer,
        seq_len=seq_len,
        overlong=overlong,
        masking=pair_masking(DataConfig(), tokenizer),
        cache=cache,
    )


def test_only_the_response_tokens_are_targets_and_the_prompt_is_shared(tmp_path, tokenizer):
    corpus = corpus_of(write(tmp_path / "p.jsonl", [TEXT, CHAT]), tokenizer)
    for p, record in enumerate([TEXT, CHAT]):
        (c_ids, c_mask), (r_ids, r_mask) = corpus.side(p, 0), corpus.side(p, 1)
        prompt = int(c_mask.int().argmax())
        # Both sides start with the same prompt tokens, none of them a target.
        assert torch.equal(c_ids[:prompt], r_ids[:prompt]) and not r_mask[:prompt].any()
        response = record["chosen"] if isinstance(record["chosen"], str) else "hello"
        # The targets are the response and the stop token that ends it, nothing else.
        assert tokenizer.decode(c_ids[c_mask]) == response + tokenizer.eos_token
        assert tokenizer.decode(r_ids[r_mask]).endswith(tokenizer.eos_token)
        assert corpus.fates[p] == SampleFate.KEPT
        assert corpus.length(p) == len(c_ids) + len(r_ids)


@given(st.integers(0, 300), st.integers(0, 300), st.integers(2, 256))
def test_side_limits_fit_the_row_and_keep_what_fits(chosen, rejected, seq_len):
    a, b = side_limits(chosen, rejected, seq_len)
    assert min(a, chosen) + min(b, rejected) <= seq_len
    if chosen + rejected <= seq_len:
        assert (a, b) == (chosen, rejected)
    elif min(chosen, rejected) <= seq_len // 2:  # the shorter side stays whole
        assert (a >= chosen) if chosen <= rejected else (b >= rejected)
        assert min(a, chosen) + min(b, rejected) == seq_len


def side(n: int, prompt: int) -> tuple[list[int], list[bool]]:
    return list(range(n)), [i >= prompt for i in range(n)]


def test_the_overlong_policy_of_a_pair():
    chosen, rejected = side(10, 4), side(12, 4)
    kept = fit_pair(chosen, rejected, seq_len=22, overlong="truncate")
    assert [fate for *_, fate in kept] == [SampleFate.KEPT] * 2
    assert kept[0][1][0] is False  # a document's first token is never a target
    cut = fit_pair(chosen, rejected, seq_len=20, overlong="truncate")
    assert [len(ids) for ids, *_ in cut] == [10, 10]
    assert [fate for *_, fate in cut] == [SampleFate.TRUNCATED] * 2
    dropped = fit_pair(chosen, rejected, seq_len=20, overlong="drop")
    assert dropped == [([], [], SampleFate.DROPPED_OVERLONG)] * 2
    # Cut to 4 tokens, the rejected side keeps no response token: the pair is dropped.
    assert fit_pair(side(16, 4), side(12, 4), seq_len=8, overlong="truncate")[0][2] == (
        SampleFate.DROPPED_OVERLONG
    )
    assert fit_pair(side(6, 6), side(6, 4), seq_len=20, overlong="truncate")[1][2] == (
        SampleFate.DROPPED_NO_LOSS
    )
    with pytest.raises(ValueError, match=r"the pair has 22 tokens .*data.overlong='error'"):
        fit_pair(chosen, rejected, seq_len=20, overlong="error")


def test_auto_drops_an_overlong_chat_pair_and_truncates_a_text_pair(tmp_path, tokenizer):
    long_text = {"prompt": "p" * 10, "chosen": "a" * 60, "rejected": "b" * 60}
    long_chat = {**CHAT, "chosen": "a" * 60, "rejected": "b" * 60}
    corpus = corpus_of(
        write(tmp_path / "p.jsonl", [long_text, long_chat, TEXT]), tokenizer, seq_len=96
    )
    assert corpus.fates == (SampleFate.TRUNCATED, SampleFate.DROPPED_OVERLONG, SampleFate.KEPT)
    assert corpus.length(0) == 96 and corpus.length(1) == 0


def test_the_cache_is_reused_and_never_read_as_sft_samples(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "p.jsonl", [TEXT, CHAT, TEXT])
    cache = DataCache(tmp_path / "cache")
    first = corpus_of(path, tokenizer, cache)
    calls = []
    real = pairs_module.fit_pair_record
    monkeypatch.setattr(
        pairs_module, "fit_pair_record", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    second = corpus_of(path, tokenizer, cache)
    assert calls == []  # read from the cache
    assert torch.equal(first.sides.input_ids, second.sides.input_ids)
    assert first.fates == second.fates
    assert torch.equal(first.sides.input_ids, corpus_of(path, tokenizer).sides.input_ids)
    # The same file as SFT data is another entry: SFT finds no prompt/completion there.
    with pytest.raises(DataError, match="needs key .completion."):
        load_corpus(
            [DataSourceConfig(path=str(path))], tokenizer, seq_len=128, overlong="auto", cache=cache
        )


def test_both_sides_of_a_pair_share_a_row_with_their_sequence_ids(tmp_path, tokenizer):
    records = [TEXT, CHAT, TEXT, CHAT, TEXT]
    source = DataSourceConfig(path=str(write(tmp_path / "p.jsonl", records)))
    data = load_pair_data(
        DataConfig(kind="sources", sources=(source,), shuffle=False),
        tokenizer,
        seed=0,
        seq_len=128,
        batch_size=2,
        micro_batch_size=1,
        dp_rank=0,
        dp_size=1,
    )
    batch = data.batch(type("P", (), {"data": DataPosition()})())
    batch.check()
    assert batch.num_samples == sum(mb.num_pairs for mb in batch.micro_batches) >= 2
    assert batch.metrics["data/num_samples"] == batch.num_samples
    corpus = data.corpus
    for mb in batch.micro_batches:
        rows = mb.rows
        for p in range(mb.num_pairs):
            for s in (0, 1):
                where = mb.sequence_ids == 2 * p + s
                (row,) = where.any(dim=1).nonzero()[0].tolist()  # one row holds the whole side
                ids = rows.input_ids[row][where[row]]
                assert rows.position_ids[row][where[row]][0] == 0  # a document of its own
                docs = rows.document_ids[row][where[row]]
                assert len(set(docs.tolist())) == 1
                assert any(
                    torch.equal(ids, corpus.side(q, s)[0]) for q in range(corpus.num_samples)
                )
        assert not rows.loss_mask[mb.sequence_ids < 0].any()


def test_a_reference_table_gives_each_micro_batch_its_pairs_rows(tmp_path, tokenizer):
    corpus = corpus_of(write(tmp_path / "p.jsonl", [TEXT, CHAT, TEXT]), tokenizer)
    table = torch.arange(6, dtype=torch.float32).view(3, 2)
    mb = pack_pairs([[2], [0, 1]], corpus, seq_len=256, pad_token_id=0, reference=table)
    assert mb.num_pairs == 3
    assert mb.ref_logps.tolist() == [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]]
