"""Preference pairs whose chosen equals their rejected are dropped and counted, and a source of
nothing else is an error before training (issue 45.5); pair messages in TRL's other forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fnt.batch import DataPosition
from fnt.config import DataConfig, DataSourceConfig
from fnt.data.cache import DataCache
from fnt.data.corpus import SampleFate
from fnt.data.pairs import (
    load_pair_corpus,
    load_pair_data,
    pair_from_record,
    pair_masking,
)
from fnt.errors import DataError
from fnt.state import Progress
from tests.e2e.helpers import config_args, run_cli

SOURCE = DataSourceConfig(path="x.jsonl")
GOOD = {"prompt": "count to 3", "chosen": "1 2 3", "rejected": "3 1"}
SAME = {"prompt": "count to 3", "chosen": "1 2 3", "rejected": "1 2 3"}


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def corpus_of(path, tokenizer, cache=None, seq_len=128):
    return load_pair_corpus(
        [DataSourceConfig(path=str(path))],
        tokenizer,
        seq_len=seq_len,
        overlong="auto",
        masking=pair_masking(DataConfig(), tokenizer),
        cache=cache,
    )


def pair_data(path, tokenizer, shuffle: bool = True, progress: bool = False):
    """The pairs of `path` as `fnt dpo` loads them, two pairs a step on one rank."""
    sources = (DataSourceConfig(path=str(path)),)
    return load_pair_data(
        DataConfig(kind="sources", sources=sources, shuffle=shuffle),
        tokenizer,
        seed=0,
        seq_len=128,
        batch_size=2,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
        progress=progress,
    )


def test_a_pair_of_equal_sides_is_dropped_counted_and_named(tmp_path, tokenizer):
    path = write(tmp_path / "pairs.jsonl", [GOOD, SAME, GOOD, SAME])
    corpus = corpus_of(path, tokenizer)
    assert corpus.fates == (SampleFate.KEPT, SampleFate.DROPPED_BAD) * 2
    assert corpus.length(1) == 0
    assert corpus.notes == (
        f"{path}: 2 pairs left out, their chosen equal to their rejected (data/dropped_bad): "
        f"{path}, line 2; {path}, line 4",
    )
    # The steps that meet them count them, as other dropped data.
    data = pair_data(path, tokenizer, shuffle=False)
    batch = data.batch(Progress(step=0, data=DataPosition(0, 0)))
    assert batch.metrics["data/dropped_bad"] == 2.0 and batch.num_samples == 2


def test_the_note_is_printed_at_the_start_and_comes_back_from_the_cache(
    tmp_path, tokenizer, capsys
):
    path = write(tmp_path / "pairs.jsonl", [SAME, GOOD] + [SAME] * 4)
    cache = DataCache(tmp_path / "cache")
    first = corpus_of(path, tokenizer, cache)
    second = corpus_of(path, tokenizer, cache)
    assert second.sides.cache_entries != ("",)  # read from the entry
    assert first.notes == second.notes
    assert first.notes[0].endswith(f"{path}, line 1; {path}, line 3; {path}, line 4; and 2 more")
    pair_data(path, tokenizer, progress=True)
    assert first.notes[0] in capsys.readouterr().out.splitlines()


def test_a_source_of_nothing_but_equal_pairs_is_an_error(tmp_path, tokenizer):
    path = write(tmp_path / "pairs.jsonl", [SAME] * 3)
    with pytest.raises(DataError) as caught:
        corpus_of(path, tokenizer)
    assert str(caught.value) == (
        f"{path}: no pair is usable: in every one of its 3 pairs the chosen response equals the "
        f"rejected one (the first at {path}, line 1), so there is nothing to prefer"
    )
    # Mixed with pairs dropped for another reason, both are counted.
    long = {"prompt": [{"role": "user", "content": "x" * 200}], "chosen": "a", "rejected": "b"}
    mixed = write(tmp_path / "mixed.jsonl", [SAME, long])
    with pytest.raises(DataError, match=r"\(1 over-long, 0 without response tokens, 1 with chosen"):
        corpus_of(mixed, tokenizer)


def test_two_equal_whole_chats_are_a_pair_of_equal_responses(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pair = pair_from_record({"chosen": chat, "rejected": chat}, SOURCE)
    assert pair.prompt == chat[:1] and pair.chosen == pair.rejected == chat[1]
    path = write(tmp_path / "pairs.jsonl", [GOOD, {"chosen": chat, "rejected": chat}])
    assert corpus_of(path, tokenizer).fates == (SampleFate.KEPT, SampleFate.DROPPED_BAD)


def test_pair_messages_may_be_sharegpt_or_text_parts():
    expected = pair_from_record(
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        },
        SOURCE,
    )
    sharegpt = {
        "prompt": [{"from": "human", "value": "hi"}],
        "chosen": [{"from": "gpt", "value": "hello"}],
        "rejected": {"from": "gpt", "value": [{"type": "text", "text": "go away"}]},
    }
    assert pair_from_record(sharegpt, SOURCE) == expected
    implicit = {
        "chosen": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
        "rejected": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "go away"}],
    }
    assert pair_from_record(implicit, SOURCE) == expected
    image = {**sharegpt, "prompt": [{"role": "user", "content": [{"type": "image"}]}]}
    with pytest.raises(ValueError, match=r"prompt\[0\]\.content\[0\] is a part of type 'image'"):
        pair_from_record(image, SOURCE)


def test_fnt_dpo_on_nothing_but_equal_pairs_is_one_line_before_the_model_loads(
    tiny_model_dir, tmp_path
):
    path = write(tmp_path / "pairs.jsonl", [SAME] * 2)
    args = config_args("examples/debug/dpo.toml", tiny_model_dir, tmp_path / "run")
    sources = json.dumps([{"path": str(path)}])
    proc = run_cli("dpo", *args, "--data.sources", sources, "--max-steps", "1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: no pair is usable: in every one of its 2 pairs the chosen response "
        f"equals the rejected one (the first at {path}, line 1), so there is nothing to prefer"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()
