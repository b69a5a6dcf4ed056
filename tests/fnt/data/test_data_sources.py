"""Source kinds: parquet, Arrow, directories and Hugging Face datasets give the corpus the same
records give as JSONL; column mapping; errors name the source and the row."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fnt.config import DataSourceConfig
from fnt.data import Corpus, DataError, load_corpus
from fnt.data.load import chat_record, without_nulls
from tests.e2e.helpers import write_datasets_cache

# Chats and prompt/completion pairs mixed, one message with a key the others lack: as columns,
# every record gets every column and every message every field, null where it has none.
RECORDS = [
    {"prompt": "two plus two", "completion": "four", "id": 1},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": "Hello!"},
        ]
    },
    {"prompt": "p", "completion": "c" * 30},
    {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    },
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def table_of(records: list[dict]) -> pa.Table:
    # pa.Table.from_pylist would take the columns of the first record only.
    return pa.Table.from_struct_array(pa.array(records))


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(table_of(records), path)
    return path


def write_arrow(path: Path, records: list[dict], *, stream: bool) -> Path:
    table = table_of(records)
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1):  # several batches, read in order
            writer.write_batch(batch)
    return path


def write_directory(path: Path, records: list[dict]) -> Path:
    """The records split over a parquet and an Arrow file, whose names give their order."""
    path.mkdir()
    write_parquet(path / "part-0.parquet", records[:1])
    write_arrow(path / "part-1.arrow", records[1:], stream=True)
    (path / "README.md").write_text("not data")
    (path / "nested").mkdir()
    write_parquet(path / "nested" / "ignored.parquet", records[:1])
    return path


def corpus(tokenizer, *sources: DataSourceConfig, seq_len: int = 64) -> Corpus:
    return load_corpus(sources, tokenizer, seq_len=seq_len, overlong="truncate")


def assert_same_samples(a: Corpus, b: Corpus) -> None:
    assert a.offsets == b.offsets and a.fates == b.fates
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.target_mask, b.target_mask)


WRITERS = {
    "parquet": lambda d, r: write_parquet(d / "train.parquet", r),
    "arrow_file": lambda d, r: write_arrow(d / "train.arrow", r, stream=False),
    "arrow_stream": lambda d, r: write_arrow(d / "train.arrow", r, stream=True),
    "directory": lambda d, r: write_directory(d / "train", r),
}


@pytest.fixture(scope="module")
def jsonl_corpus(tokenizer, tmp_path_factory) -> Corpus:
    path = write_jsonl(tmp_path_factory.mktemp("jsonl") / "train.jsonl", RECORDS)
    return corpus(tokenizer, DataSourceConfig(path=str(path)))


@pytest.mark.parametrize("kind", WRITERS)
def test_a_columnar_source_gives_the_samples_of_the_same_records_as_jsonl(
    tokenizer, tmp_path, jsonl_corpus, kind
):
    path = WRITERS[kind](tmp_path, RECORDS)
    read = corpus(tokenizer, DataSourceConfig(path=str(path)))
    assert read.source_names == ("train",)
    assert_same_samples(read, jsonl_corpus)


def test_a_glob_reads_the_matching_files_in_name_order_each_by_its_suffix(
    tokenizer, tmp_path, jsonl_corpus
):
    write_jsonl(tmp_path / "train-2.jsonl", RECORDS[3:])
    write_parquet(tmp_path / "train-0.parquet", RECORDS[:1])
    write_arrow(tmp_path / "train-1.arrow", RECORDS[1:3], stream=False)
    write_parquet(tmp_path / "test-0.parquet", RECORDS)
    pattern = str(tmp_path / "train-*")
    assert_same_samples(corpus(tokenizer, DataSourceConfig(path=pattern)), jsonl_corpus)
    with pytest.raises(DataError, match="the pattern matches no file"):
        corpus(tokenizer, DataSourceConfig(path=str(tmp_path / "valid-*.parquet")))


def test_configured_columns_are_read_and_same_named_other_columns_ignored(
    tokenizer, tmp_path, jsonl_corpus
):
    # Rows that also carry unrelated columns named like the defaults (as some Hub datasets do).
    renamed = []
    for r in RECORDS:
        if "messages" in r:
            renamed.append({"chat": r["messages"], "prompt": "unrelated", "completion": "x"})
        else:
            renamed.append({"question": r["prompt"], "answer": r["completion"], "messages": None})
    path = write_parquet(tmp_path / "renamed.parquet", renamed)
    source = DataSourceConfig(
        path=str(path), messages_column="chat", prompt_column="question", completion_column="answer"
    )
    assert_same_samples(corpus(tokenizer, source), jsonl_corpus)


def test_chat_record_maps_columns_and_passes_other_keys_through():
    source = DataSourceConfig(
        messages_column="conversation", prompt_column="", completion_column=""
    )
    record = {"conversation": [{"role": "user"}], "tools": [1], "prompt": "p", "messages": 0}
    assert chat_record(record, source) == {"tools": [1], "messages": [{"role": "user"}]}
    assert chat_record([1], source) == [1]  # fnt.data.chat names what is wrong with it


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": [], "question": "q"}, "both the messages column 'messages'"),
        ({"question": "q"}, "needs key 'answer'"),
        (
            {"txt": "t"},
            "expected keys 'question' and 'answer', or 'messages', or 'conversations', or "
            "'text'; got keys ['txt']",
        ),
    ],
)
def test_chat_record_names_the_columns_a_bad_record_lacks_or_mixes(record, reason):
    source = DataSourceConfig(prompt_column="question", completion_column="answer")
    with pytest.raises(ValueError, match=re.escape(reason)):
        chat_record(record, source)


def test_without_nulls_drops_null_fields_at_every_depth_and_keeps_list_items():
    row = {"a": None, "m": [{"x": 1, "y": None}, {"z": {"w": None}}], "l": [None, 2]}
    assert without_nulls(row) == {"m": [{"x": 1}, {"z": {}}], "l": [None, 2]}


@pytest.mark.parametrize("kind", ["parquet", "arrow_stream"])
def test_a_bad_row_names_the_file_and_its_0_based_row_index(tokenizer, tmp_path, kind):
    records = [RECORDS[0], RECORDS[2], {"prompt": "p", "completion": None}]
    path = WRITERS[kind](tmp_path, records)
    with pytest.raises(
        DataError, match=re.escape(f"{path}, row index 2: a prompt/completion record needs key")
    ):
        corpus(tokenizer, DataSourceConfig(path=str(path)))


def test_a_bad_row_in_a_directory_names_its_file(tokenizer, tmp_path):
    path = write_directory(tmp_path / "d", [RECORDS[0], RECORDS[1], {"prompt": "only"}])
    with pytest.raises(DataError, match=re.escape(f"{path / 'part-1.arrow'}, row index 1: ")):
        corpus(tokenizer, DataSourceConfig(path=str(path)))


def test_unreadable_and_empty_sources_name_the_source(tokenizer, tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match=re.escape(f"cannot read data source {fake}")):
        corpus(tokenizer, DataSourceConfig(path=str(fake)))
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"messages": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match=re.escape(f"{empty}: the parquet has no rows")):
        corpus(tokenizer, DataSourceConfig(path=str(empty)))
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="the directory has no .parquet or .arrow files"):
        corpus(tokenizer, DataSourceConfig(path=str(tmp_path / "none")))
    saved = tmp_path / "saved_dict"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match=r"DatasetDict saved with save_to_disk.*\['train'\]"):
        corpus(tokenizer, DataSourceConfig(path=str(saved)))


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets, from a datasets cache made here


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch) -> SimpleNamespace:
    """An empty datasets cache that this process's `datasets` uses (HF_DATASETS_CACHE set at
    import is read from datasets.config at each call), and a record of every DNS look-up."""
    import datasets

    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    lookups = []

    def no_network(host, *args, **kwargs):
        lookups.append(host)
        raise OSError(f"test: no network for {host}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    return SimpleNamespace(dir=cache, lookups=lookups)


def test_a_cached_dataset_gives_the_samples_of_its_records_without_asking_the_hub(
    tokenizer, datasets_cache, jsonl_corpus
):
    write_datasets_cache(
        RECORDS, datasets_cache.dir, "local/tiny_chat", subset="chat", split="valid"
    )
    source = DataSourceConfig(dataset="local/tiny_chat", subset="chat", split="valid")
    read = corpus(tokenizer, source)
    assert read.source_names == ("tiny_chat",)
    assert_same_samples(read, jsonl_corpus)
    assert datasets_cache.lookups == []  # the cache is read first, with the Hub switched off


def test_a_bad_dataset_row_names_the_dataset_split_and_row(tokenizer, datasets_cache):
    write_datasets_cache(
        [RECORDS[0], {"prompt": "p", "completion": "c", "messages": []}],
        datasets_cache.dir,
        "local/mixed",
    )
    with pytest.raises(
        DataError,
        match=re.escape(
            "dataset 'local/mixed' (subset 'default', split 'train'), row index 1: the record "
            "has both"
        ),
    ):
        corpus(tokenizer, DataSourceConfig(dataset="local/mixed", subset="default"))


def test_an_uncached_dataset_in_offline_mode_names_the_dataset_and_the_fix(
    tokenizer, datasets_cache, monkeypatch
):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 sets
    write_datasets_cache(RECORDS, datasets_cache.dir, "local/tiny_chat")
    with pytest.raises(
        DataError,
        match=r"Hugging Face dataset 'org/missing' \(split 'train'\) is not in the local "
        r"datasets cache .* offline mode is on .* Load it once with network access",
    ):
        corpus(tokenizer, DataSourceConfig(dataset="org/missing"))
    with pytest.raises(DataError, match=r"split 'test'.*Unknown split \"test\""):
        corpus(tokenizer, DataSourceConfig(dataset="local/tiny_chat", split="test"))
    assert datasets_cache.lookups == []
