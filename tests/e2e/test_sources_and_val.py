"""Data sources and validation in real runs: a parquet source and a Hugging Face dataset from a
local datasets cache train and resume exactly; val/* rows at the interval, at 1 and 2 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_script,
    write_datasets_cache,
)

N, K = 4, 2
INTERVAL = 2
EXACT_KEYS = (
    "loss/mean",
    "optim/grad_norm",
    "progress/num_samples",
    "progress/num_tokens",
    "progress/reverse/ratio_tokens",  # the dataset's share: its samples are read and packed
)
VAL_KEYS = {"val/loss", "val/perplexity", "val/num_tokens"}
START_KEYS = {"val/start/loss", "val/start/perplexity", "val/start/num_tokens"}


def records(count: int, offset: int) -> list[dict]:
    """Reverse-the-word samples, as prompt/completion pairs and as chats."""
    out = []
    for i in range(offset, offset + count):
        word = "".join("abcdefghij"[(i * 7 + j) % 10] for j in range(3 + i % 5))
        if i % 2:
            out.append({"prompt": f"reverse {word}", "completion": word[::-1]})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": f"reverse {word}"},
                        {"role": "assistant", "content": word[::-1]},
                    ]
                }
            )
    return out


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
    return path


def write_data(root: Path) -> dict:
    """Training data in a parquet file and in a Hugging Face dataset of a datasets cache made
    here (found offline through HF_HOME), held-out data in a parquet and a JSONL file."""
    root.mkdir(parents=True)
    val_jsonl = root / "held_out.jsonl"
    val_jsonl.write_text("".join(json.dumps(r) + "\n" for r in records(3, 100)))
    write_datasets_cache(records(10, 50), root / "hf_home" / "datasets", "local/reverse")
    return {
        "train": write_parquet(root / "train.parquet", records(24, 0)),
        "val_parquet": write_parquet(root / "val.parquet", records(5, 200)),
        "val_jsonl": val_jsonl,
        "env": {"HF_HOME": str(root / "hf_home"), "HF_DATASETS_OFFLINE": "1"},
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return write_data(tmp_path_factory.mktemp("sources") / "data")


def args(model_dir, out, data, *extra):
    train_sources = [{"path": str(data["train"])}, {"dataset": "local/reverse", "weight": 0.5}]
    val_sources = [{"path": str(data["val_parquet"])}, {"path": str(data["val_jsonl"])}]
    return config_args(
        "examples/debug/sft.toml",
        model_dir,
        out,
        "--max-steps",
        str(N),
        "--data.kind",
        "sources",
        "--data.sources",
        json.dumps(train_sources),
        "--val.sources",
        json.dumps(val_sources),
        "--val.interval",
        str(INTERVAL),
        "--val.eval-on-start",
        *extra,
    )


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("val1") / "run"
    run_script(
        "sft.py", *args(tiny_model_dir, out, data, "--ckpt.interval", str(K)), env=data["env"]
    )
    return out


def assert_val_rows(rows: list[dict], first_step: int) -> None:
    """val/* exactly in the rows of due steps, val/start/* only in the first row, time/val in
    every row, the loss finite and its perplexity its exp."""
    assert [r["step"] for r in rows] == list(range(first_step, N + 1))
    for row in rows:
        due = row["step"] % INTERVAL == 0
        assert VAL_KEYS & row.keys() == (VAL_KEYS if due else set()), row
        assert START_KEYS & row.keys() == (START_KEYS if row["step"] == first_step else set())
        assert row["time/val"] >= 0.0
        for prefix in ("val/", "val/start/"):
            if prefix + "loss" in row:
                assert math.isfinite(row[prefix + "loss"]) and row[prefix + "num_tokens"] > 0
                assert row[prefix + "perplexity"] == pytest.approx(math.exp(row[prefix + "loss"]))


def test_validation_rows_at_one_rank(one_rank):
    rows = read_metrics(one_rank)
    assert_val_rows(rows, 1)
    # The same held-out tokens every time; the trained model fits them better than the start.
    assert {r["val/num_tokens"] for r in rows if "val/loss" in r} == {
        rows[0]["val/start/num_tokens"]
    }
    assert rows[-1]["val/loss"] < rows[0]["val/start/loss"]
    assert rows[0]["time/val"] > 0 and rows[1]["time/val"] > 0 and rows[2]["time/val"] == 0
    assert all(0 < r["progress/reverse/ratio_samples"] < 1 for r in rows)


@pytest.mark.numerics
def test_parquet_and_dataset_sources_resume_exactly_and_a_resumed_start_evaluates_the_checkpoint(
    one_rank, tiny_model_dir, data, tmp_path
):
    resumed = tmp_path / "resumed"
    copy_crashed_run(one_rank, resumed, K)
    run_script(
        "sft.py", *args(tiny_model_dir, resumed, data, "--resume", "latest"), env=data["env"]
    )
    assert_resumed_run_matches(one_rank, resumed, K, N, EXACT_KEYS, tmp_path)
    full, rows = read_metrics(one_rank), read_metrics(resumed)
    assert_val_rows(rows[K:], K + 1)
    assert [r["val/loss"] for r in rows[K:] if "val/loss" in r] == [full[N - 1]["val/loss"]]
    # The resumed run's start state is the checkpoint of step K, evaluated as row K was.
    assert rows[K]["val/start/loss"] == full[K - 1]["val/loss"]


def two_rank_job(fixture, out):
    """The same run at two ranks, on a copy of the data (the launch's HF_HOME is the copy's)."""
    data = write_data(out / "data")
    run_args = args(fixture("tiny_model_dir"), out / "run", data)
    return {"call": "fnt.__main__:main", "args": [["sft", *run_args]], "env": data["env"]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=two_rank_job)
def test_validation_rows_at_two_ranks_match_one_rank(one_rank, two_rank_runs):
    rows1, rows2 = read_metrics(one_rank), read_metrics(two_rank_runs(two_rank_job) / "run")
    assert_val_rows(rows2, 1)
    for r1, r2 in zip(rows1, rows2):
        for key in (*VAL_KEYS, *START_KEYS) & r1.keys():
            assert r2[key] == pytest.approx(r1[key], rel=1e-5), (r1["step"], key)


@pytest.mark.slow
def test_a_dataset_missing_from_the_cache_offline_exits_2_naming_it(tiny_model_dir, data, tmp_path):
    missing = run_script(
        "sft.py",
        *args(tiny_model_dir, tmp_path / "run", data, "--data.sources", '[{"dataset": "org/x"}]'),
        env=data["env"],
        check=False,
    )
    assert missing.returncode == 2
    assert "error: Hugging Face dataset 'org/x' (split 'train') is not in the local" in (
        missing.stderr
    )
