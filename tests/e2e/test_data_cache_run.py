"""The tokenized-data cache in real runs: a resume reads its data from the cache, and another
run pointed at the same data.cache_dir too; a damaged, cut or pickled entry, or a share damaged
under two ranks, is reported and tokenized again, and the run trains as an uncached one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import config_args, read_metrics, run_cli
from tests.fnt.data.test_data_cache import DAMAGES, Payload, alter_token_ids, array_bytes

EXACT_KEYS = ("loss/mean", "optim/grad_norm", "progress/num_tokens", "progress/num_samples")


def write_chats(path: Path, count: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"count to {i}", "completion": " ".join(map(str, range(i % 9)))})
            + "\n"
            for i in range(count)
        )
    )
    return path


def sft_args(model_dir, out, data: Path, *extra: str) -> tuple[str, ...]:
    sources = ("--data.kind", "sources", "--data.sources", json.dumps([{"path": str(data)}]))
    return config_args("examples/debug/sft.toml", model_dir, out, *sources, *extra)


def test_a_resume_and_another_run_read_the_tokenized_data_from_the_cache(tiny_model_dir, tmp_path):
    data = write_chats(tmp_path / "train.jsonl", 20)

    def sft(out, *extra):
        return run_cli("sft", *sft_args(tiny_model_dir, out, data, *extra)).stdout

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


STEPS = 4


@pytest.fixture(scope="module")
def uncached(tiny_model_dir, tmp_path_factory) -> dict:
    """A 300-chat source and a run that tokenized it into a fresh cache."""
    root = tmp_path_factory.mktemp("uncached")
    data = write_chats(root / "train.jsonl", 300)
    cache = root / "cache"
    args = sft_args(tiny_model_dir, root / "run", data, "--max-steps", str(STEPS))
    run_cli("sft", *args, "--data.cache-dir", str(cache))
    (entry,) = cache.iterdir()
    return {"data": data, "cache": cache, "entry": entry, "rows": read_metrics(root / "run")}


def pickle_in_place_of(entry: Path) -> Path:
    """An older fnt's entry for the same key: `{key}.pt`, a pickle (that would make a folder)."""
    legacy = entry.with_suffix(".pt")
    torch.save({"format": 1, "ids": Payload(entry.parent / "code-ran")}, legacy)
    entry.unlink()
    return legacy


@pytest.mark.parametrize("damage", ["token-ids", "truncated", "pickled"])
def test_a_damaged_cache_entry_is_reported_and_rebuilt_and_the_run_trains_as_uncached(
    tiny_model_dir, uncached, tmp_path, damage
):
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = cache / uncached["entry"].name
    entry.write_bytes(uncached["entry"].read_bytes())
    if damage == "pickled":
        named = pickle_in_place_of(entry)
        what = "a pickled cache entry of an older fnt, not loaded (a cache is read as data only)"
    elif damage == "truncated":
        named, full = entry, entry.stat().st_size
        entry.write_bytes(entry.read_bytes()[: array_bytes(entry, "ids")[1] // 2])
        what = f"{entry.stat().st_size} bytes, {full} recorded (truncated or overwritten)"
    else:
        named = entry
        alter_token_ids(entry)
        what = DAMAGES["token-ids"][1]
    args = sft_args(tiny_model_dir, tmp_path / "run", uncached["data"], "--max-steps", str(STEPS))
    out = run_cli("sft", *args, "--data.cache-dir", str(cache)).stdout
    assert f"{named}: {what}; removed it, tokenizing the source again" in out.splitlines()
    assert "tokenized samples from the cache" not in out and "tokenizing " in out
    assert not (cache / "code-ran").exists()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, expected in zip(rows, uncached["rows"]):
        for key in EXACT_KEYS:
            assert row[key] == expected[key], (row["step"], key)
    assert entry.read_bytes() == uncached["entry"].read_bytes()  # rebuilt as it was


# ---------------------------------------------------------------------------------------------
# Two ranks


def run_args(fixture, out: Path) -> list:
    """`fnt sft` on a 300-chat source with a cache of its own, as a two-rank job's args."""
    out.mkdir(parents=True, exist_ok=True)
    data = write_chats(out / "train.jsonl", 300)
    args = sft_args(fixture("tiny_model_dir"), out / "run", data, "--max-steps", str(STEPS))
    return [["sft", *args, "--data.cache-dir", str(out / "cache")]]


def two_rank_job(fixture, out):
    return {"call": "fnt.__main__:main", "args": run_args(fixture, out)}


def damaged_share_job(fixture, out):
    return {"call": f"{__name__}:sft_with_a_damaged_share", "args": run_args(fixture, out)}


def sft_with_a_damaged_share(argv: list[str]) -> None:
    """`fnt` with argv, where rank 1 damages its share of the tokenized source on disk right
    after writing it, before rank 0 reads it."""
    import fnt.data.cache as cache_module
    from fnt.__main__ import main

    write = cache_module.write_entry_

    def write_then_damage(samples, path: Path) -> None:
        write(samples, path)
        if path.name.endswith(".share1.safetensors"):
            alter_token_ids(path)

    cache_module.write_entry_ = write_then_damage
    try:
        main(argv)
    finally:
        cache_module.write_entry_ = write


@pytest.mark.two_ranks(job=two_rank_job)
@pytest.mark.two_ranks(job=damaged_share_job)
def test_at_two_ranks_a_damaged_share_is_tokenized_again_and_the_run_trains_as_undamaged(
    two_rank_runs,
):
    plain, damaged = two_rank_runs(two_rank_job), two_rank_runs(damaged_share_job)
    (entry,) = (damaged / "cache").iterdir()  # the shares are removed
    share = entry.with_name(entry.name.replace(".safetensors", ".share1.safetensors"))
    assert (
        f"{share}: contents differ from its recorded checksum (damaged on disk); tokenized that "
        "share again"
    ) in (damaged / "rank0.log").read_text().splitlines()
    (plain_entry,) = (plain / "cache").iterdir()
    assert entry.read_bytes() == plain_entry.read_bytes()
    rows, expected = read_metrics(damaged / "run"), read_metrics(plain / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, want in zip(rows, expected):
        for key in EXACT_KEYS:
            assert row[key] == want[key], (row["step"], key)
