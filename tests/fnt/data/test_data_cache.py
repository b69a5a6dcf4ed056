"""Tokenize once: the cache of tokenized sources is reused by a second load, missed by any
change the samples depend on, and a source tokenized in shares over ranks is the same as one
tokenized whole."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest

import fnt.data.load as load_module
from fnt.config import DataSourceConfig
from fnt.data import DataError, load_corpus
from fnt.data.cache import CACHE_FORMAT, DataCache, merge_shares
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


class ThreadRanks:
    """`DataCache.gather` for ranks that are threads of this process, with a real barrier."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size)
        self.values: list = [None] * world_size

    def gather(self, rank: int):
        def gather(value):
            self.values[rank] = value
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()  # no rank writes the next value before all have read this one
            return out

        return gather


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
    ranks = ThreadRanks(2)
    results = {}

    def rank(r):
        cache = DataCache(tmp_path / "cache", rank=r, world_size=2, gather=ranks.gather(r))
        results[r] = corpus_fields(load(path, tokenizer, cache))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(counted) == len(RECORDS)  # each record tokenized once, by one of the two
    expected = corpus_fields(load(path, tokenizer, None))
    assert results[0] == results[1] == expected
    (entry,) = (tmp_path / "cache").iterdir()  # the shares are removed
    assert entry.suffix == ".safetensors" and ".share" not in entry.name


def test_a_bad_record_is_reported_by_every_rank_alike(tmp_path, tokenizer):
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    # Renders fine but cannot be masked: a template error appears only when tokenizing.
    template = "{{ raise_exception('no') }}"
    path = write(tmp_path / "train.jsonl", RECORDS[:3] + [bad])
    masking = ChatMasking(stop_ids=frozenset(), chat_template=template)
    with pytest.raises(DataError, match=r"line 1: the chat template failed"):
        load(path, tokenizer, DataCache(tmp_path / "cache"), masking=masking)
    assert not any(p.suffix == ".safetensors" for p in (tmp_path / "cache").iterdir())


def test_an_entry_is_a_plain_safetensors_file(tmp_path, tokenizer):
    """Any safetensors reader opens an entry: flat integer arrays, no pickle."""
    from safetensors.numpy import load_file

    path = write(tmp_path / "train.jsonl", RECORDS)
    load(path, tokenizer, DataCache(tmp_path / "cache"))
    (entry,) = (tmp_path / "cache").iterdir()
    arrays = load_file(entry)
    assert arrays["ids"].dtype == np.int64 and len(arrays["lengths"]) == len(arrays["fates"])
    assert sum(arrays["lengths"]) == len(arrays["ids"]) == len(arrays["targets"])


# ---------------------------------------------------------------------------------------------
# A cache entry is checked before it is used


def entry_in(directory: Path) -> Path:
    (entry,) = [p for p in directory.iterdir() if p.name.endswith(".safetensors")]
    return entry


def array_bytes(entry: Path, name: str) -> tuple[int, int]:
    """Where array `name`'s bytes lie in an entry file: (start, end)."""
    size = int.from_bytes(entry.read_bytes()[:8], "little")
    start, end = json.loads(entry.read_bytes()[8 : 8 + size])[name]["data_offsets"]
    return 8 + size + start, 8 + size + end


def alter_token_ids(entry: Path) -> None:
    """The low byte of every other id changed: what the issue's run trained on unnoticed."""
    data = bytearray(entry.read_bytes())
    start, end = array_bytes(entry, "ids")
    for offset in range(start, end, 16):
        data[offset] ^= 0x5A
    entry.write_bytes(bytes(data))


def rewrite_format(entry: Path) -> None:
    """The entry as a later fnt might write it: another format number, a valid digest."""
    from safetensors.numpy import load_file, save_file

    with open(entry, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(size))["__metadata__"]
    save_file(load_file(entry), entry, metadata={**meta, "format": str(CACHE_FORMAT + 1)})


DAMAGES = {
    "token-ids": (alter_token_ids, "contents differ from its recorded checksum (damaged on disk)"),
    "truncated": (
        lambda p: p.write_bytes(p.read_bytes()[: array_bytes(p, "ids")[1] - 3]),
        "{size} bytes, {full} recorded (truncated or overwritten)",
    ),
    "header": (
        lambda p: p.write_bytes(p.read_bytes()[:9] + b"\0" + p.read_bytes()[10:]),
        "unreadable header",
    ),
    "empty": (lambda p: p.write_bytes(b""), "0 bytes, not a cache entry (truncated)"),
    "format": (
        rewrite_format,
        f"written in cache format '{CACHE_FORMAT + 1}'; this fnt reads format {CACHE_FORMAT}",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_reported_removed_and_tokenized_again(
    tmp_path, tokenizer, counted, capsys, damage
):
    path = write(tmp_path / "train.jsonl", RECORDS)
    cache = DataCache(tmp_path / "cache")
    load(path, tokenizer, cache)
    entry = entry_in(cache.directory)
    full = entry.stat().st_size
    spoil, what = DAMAGES[damage]
    spoil(entry)
    size = entry.stat().st_size
    capsys.readouterr()
    counted.clear()
    corpus = load(path, tokenizer, cache)
    assert corpus_fields(corpus) == corpus_fields(load(path, tokenizer, None))
    assert len(counted) == 2 * len(RECORDS)  # tokenized again (and once more, uncached)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if str(entry) in line]
    assert line.startswith(f"{entry}: {what.format(size=size, full=full)}"), line
    assert line.endswith("; removed it, tokenizing the source again")
    assert corpus.cache_entries == ("",)  # not read from the cache
    counted.clear()
    again = load(path, tokenizer, cache)  # the rebuilt entry passes
    assert not counted and again.cache_entries == (str(entry),)


class Payload:
    """Unpickling this makes a directory: a pickle can run anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.mkdir, (self.marker,)


def test_a_pickled_entry_of_an_older_fnt_is_never_unpickled_but_replaced(
    tmp_path, tokenizer, counted, capsys
):
    import torch

    path = write(tmp_path / "train.jsonl", RECORDS)
    cache = DataCache(tmp_path / "cache")
    load(path, tokenizer, cache)
    entry = entry_in(cache.directory)
    # An older fnt kept the same key in `{key}.pt`, a torch.save pickle.
    legacy = entry.with_suffix(".pt")
    marker = tmp_path / "code-ran"
    torch.save({"format": 1, "ids": Payload(marker)}, legacy)
    entry.unlink()
    capsys.readouterr()
    counted.clear()
    corpus = load(path, tokenizer, cache)
    assert not marker.exists()
    assert len(counted) == len(RECORDS)
    assert capsys.readouterr().out.splitlines() == [
        f"{legacy}: a pickled cache entry of an older fnt, not loaded (a cache is read as data "
        "only); removed it, tokenizing the source again"
    ]
    assert sorted(p.name for p in cache.directory.iterdir()) == [entry.name]
    assert corpus_fields(corpus) == corpus_fields(load(path, tokenizer, None))


def test_a_share_damaged_on_disk_is_tokenized_again_and_both_ranks_merge_the_same(
    tmp_path, tokenizer, counted, capsys
):
    """Two ranks as threads: rank 1's share is damaged after it wrote it; rank 0 refuses it
    and tokenizes that share itself, rank 1 keeps its own, both end with the uncached corpus."""
    path = write(tmp_path / "train.jsonl", RECORDS)
    ranks = ThreadRanks(2)
    results, calls = {}, []

    def rank(r):
        gather = ranks.gather(r)

        def spoiling_gather(value):
            calls.append(r)
            if r == 1 and calls.count(1) == 2:  # the share is written, not yet read
                (share,) = (tmp_path / "cache").glob("*.share1.safetensors")
                alter_token_ids(share)
            return gather(value)

        cache = DataCache(tmp_path / "cache", rank=r, world_size=2, gather=spoiling_gather)
        results[r] = corpus_fields(load(path, tokenizer, cache))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(counted) == len(RECORDS) + len(RECORDS) // 2  # share 1 twice
    assert results[0] == results[1] == corpus_fields(load(path, tokenizer, None))
    (line,) = capsys.readouterr().out.splitlines()
    entry = entry_in(tmp_path / "cache")
    share = entry.with_name(entry.name.replace(".safetensors", ".share1.safetensors"))
    assert line == (
        f"{share}: contents differ from its recorded checksum (damaged on disk); tokenized that "
        "share again"
    )
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]
