"""Tokenize once: the cache of tokenized sources is reused by a second load, missed by any
change the samples depend on, and a source tokenized in shares over ranks is the same as one
tokenized whole."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

import fnt.data.load as load_module
from fnt.config import DataSourceConfig
from fnt.data import DataError, load_corpus
from fnt.data.cache import DataCache, merge_shares
from fnt.data.chat import ChatMasking
from fnt.data.load import tokenize_share
from fnt.model.tokenizer import stop_token_ids

RECORDS = [
    {"prompt": f"count to {i}", "completion": " ".join(map(str, range(1, i + 2)))} for i in range(7)
] + [
    {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "left out"},
        ]
    }
]


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def counted(monkeypatch):
    """How many records were tokenized (fit_record calls)."""
    calls = []
    real = load_module.fit_record

    def counting(record, *args, **kwargs):
        calls.append(record)
        return real(record, *args, **kwargs)

    monkeypatch.setattr(load_module, "fit_record", counting)
    return calls


def corpus_fields(corpus):
    return (
        corpus.input_ids.tolist(),
        corpus.target_mask.tolist(),
        corpus.offsets,
        corpus.fates,
        corpus.source_names,
        corpus.notes,
    )


def load(path, tokenizer, cache, **overrides):
    options = {"seq_len": 64, "overlong": "auto", **overrides}
    return load_corpus([DataSourceConfig(path=str(path))], tokenizer, cache=cache, **options)


def test_a_second_load_reads_the_cache_and_tokenizes_nothing(tmp_path, tokenizer, counted):
    path = write(tmp_path / "train.jsonl", RECORDS)
    cache = DataCache(tmp_path / "cache")
    first = load(path, tokenizer, cache)
    assert len(counted) == len(RECORDS)
    second = load(path, tokenizer, cache)
    assert len(counted) == len(RECORDS)  # no record tokenized again
    assert corpus_fields(first) == corpus_fields(second)
    assert corpus_fields(first) == corpus_fields(load(path, tokenizer, None))  # as uncached
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.parametrize(
    "change",
    ["seq_len", "overlong", "template", "file", "loss_mask"],
)
def test_any_change_the_samples_depend_on_misses_the_cache(tmp_path, tokenizer, counted, change):
    path = write(tmp_path / "train.jsonl", RECORDS)
    cache = DataCache(tmp_path / "cache")
    load(path, tokenizer, cache)
    stops = stop_token_ids(tokenizer, tokenizer.name_or_path)
    overrides = {
        "seq_len": {"seq_len": 48},
        "overlong": {"overlong": "truncate"},
        "template": {
            "masking": ChatMasking(
                stop_ids=stops, chat_template="{# v2 #}" + tokenizer.chat_template
            )
        },
        "loss_mask": {
            "masking": ChatMasking(stop_ids=stops, roles=frozenset({"assistant", "user"}))
        },
        "file": {},
    }[change]
    if change == "file":
        write(path, RECORDS[:-1] + [RECORDS[0]])
    counted.clear()
    load(path, tokenizer, cache, **overrides)
    assert len(counted) == len(RECORDS)
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_shares_merged_are_the_source_tokenized_whole(tmp_path, tokenizer, world_size):
    source = DataSourceConfig(path=str(write(tmp_path / "train.jsonl", RECORDS)))
    masking = ChatMasking(stop_ids=stop_token_ids(tokenizer, tokenizer.name_or_path))
    options = dict(seq_len=64, overlong="auto", masking=masking, progress=False)
    whole = tokenize_share(source, tokenizer, rank=0, world_size=1, **options)
    shares = [
        tokenize_share(source, tokenizer, rank=r, world_size=world_size, **options)
        for r in range(world_size)
    ]
    assert dataclasses.asdict(merge_shares(shares)) == dataclasses.asdict(whole)
    assert whole.trailing == [(7, f"{source.path}, line 8")]


def test_ranks_tokenize_a_share_each_and_all_get_the_whole_source(tmp_path, tokenizer, counted):
    """Two "ranks" as threads with a real barrier: each tokenizes half the records, both end
    with the corpus one process makes, and the entry is then read by a later load."""
    path = write(tmp_path / "train.jsonl", RECORDS)
    barrier = threading.Barrier(2)
    results = {}

    def rank(r):
        cache = DataCache(tmp_path / "cache", rank=r, world_size=2, barrier=barrier.wait)
        results[r] = corpus_fields(load(path, tokenizer, cache))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(counted) == len(RECORDS)  # each record tokenized once, by one of the two
    expected = corpus_fields(load(path, tokenizer, None))
    assert results[0] == results[1] == expected
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".pt"]  # shares removed


def test_a_bad_record_is_reported_by_every_rank_alike(tmp_path, tokenizer):
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    # Renders fine but cannot be masked: a template error appears only when tokenizing.
    template = "{{ raise_exception('no') }}"
    path = write(tmp_path / "train.jsonl", RECORDS[:3] + [bad])
    masking = ChatMasking(stop_ids=frozenset(), chat_template=template)
    with pytest.raises(DataError, match=r"line 1: the chat template failed"):
        load(path, tokenizer, DataCache(tmp_path / "cache"), masking=masking)
    assert not any(p.suffix == ".pt" for p in (tmp_path / "cache").iterdir())


def test_the_cached_ids_are_int64_tensors(tmp_path, tokenizer):
    path = write(tmp_path / "train.jsonl", RECORDS)
    load(path, tokenizer, DataCache(tmp_path / "cache"))
    (entry,) = (tmp_path / "cache").iterdir()
    state = torch.load(entry, weights_only=False)
    assert state["ids"].dtype == torch.int64 and len(state["lengths"]) == len(state["fates"])
