"""The tokenized-data cache in real runs: a resume reads its data from the cache, and another
run pointed at the same data.cache_dir too."""

from __future__ import annotations

import json

from tests.e2e.helpers import config_args, read_metrics, run_cli


def test_a_resume_and_another_run_read_the_tokenized_data_from_the_cache(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"count to {i}", "completion": "1 2 3"}) + "\n" for i in range(20)
        )
    )
    sources = ("--data.kind", "sources", "--data.sources", json.dumps([{"path": str(data)}]))

    def sft(out, *extra):
        args = config_args("examples/debug/sft.toml", tiny_model_dir, out, *sources, *extra)
        return run_cli("sft", *args).stdout

    first = sft(tmp_path / "run", "--max-steps", "2")
    assert "tokenizing " in first and "from the cache" not in first
    resumed = sft(tmp_path / "run", "--max-steps", "3", "--resume", "latest")
    assert "tokenizing " not in resumed and "tokenized samples from the cache" in resumed
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert len(list((tmp_path / "run" / "data_cache").iterdir())) == 1

    shared = tmp_path / "shared_cache"
    sft(tmp_path / "a", "--max-steps", "1", "--data.cache-dir", str(shared))
    other = sft(tmp_path / "b", "--max-steps", "1", "--data.cache-dir", str(shared))
    assert "tokenized samples from the cache" in other
    assert not (tmp_path / "b" / "data_cache").exists()
