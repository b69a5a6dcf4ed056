"""The tokenized-data cache in real runs: a resume reads its data from the cache, and another
run pointed at the same data.cache_dir too; a damaged, cut or pickled entry, or a share damaged
under two ranks, is reported and tokenized again, and the run trains as an uncached one."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from fnt.data.cache import read_entry
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


def samples_in(entry: Path) -> dict:
    """What a cache entry holds (its bytes may differ: safetensors writes the metadata in no
    fixed order)."""
    return dataclasses.asdict(read_entry(entry))


def without_dirs(held: dict, run_dir: Path) -> dict:
    """`samples_in`'s dict with the run's directory taken out of the notes' locations."""
    return json.loads(json.dumps(held, default=list).replace(str(run_dir), "RUN"))


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
    assert samples_in(entry) == samples_in(uncached["entry"])  # rebuilt as it was


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
    # The located notes name each run's own data file: the same records, in another directory.
    assert without_dirs(samples_in(entry), damaged) == without_dirs(samples_in(plain_entry), plain)
    rows, expected = read_metrics(damaged / "run"), read_metrics(plain / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, want in zip(rows, expected):
        for key in EXACT_KEYS:
            assert row[key] == want[key], (row["step"], key)


# ---------------------------------------------------------------------------------------------
# Soak: random damage to cache entries and to the shares of two ranks

SOAK_RUNS = 20
SOAK_SHARE_RUNS = 8


def two_source_args(model_dir, out: Path, root: Path, cache: Path) -> tuple[str, ...]:
    sources = [{"path": str(root / "train.jsonl")}, {"path": str(root / "more.jsonl")}]
    return config_args(
        "examples/debug/sft.toml",
        model_dir,
        out,
        *("--data.kind", "sources", "--data.sources", json.dumps(sources)),
        *("--max-steps", str(STEPS), "--data.cache-dir", str(cache)),
    )


@pytest.mark.slow
def test_soak_random_damage_to_cache_entries_is_always_reported_and_rebuilt(
    tiny_model_dir, tmp_path
):
    """20 runs on two sources, each run's cache a copy of a good one with 1 to 3 random
    damages (a cut, a flipped bit, a zeroed 4 KiB block) to its entries: every entry whose
    bytes changed is named in one line and tokenized again, every other one is read, and every
    run's rows equal those of the run that filled the cache."""
    from tests.e2e.test_damaged_run_dirs import damage_file_at_random

    write_chats(tmp_path / "train.jsonl", 300)
    write_chats(tmp_path / "more.jsonl", 120)
    good = tmp_path / "cache"
    run_cli("sft", *two_source_args(tiny_model_dir, tmp_path / "first", tmp_path, good))
    expected = read_metrics(tmp_path / "first")
    entries = sorted(p.name for p in good.iterdir())
    assert len(entries) == 2
    for seed in range(SOAK_RUNS):
        rng = random.Random(seed)
        cache = tmp_path / f"cache{seed}"
        shutil.copytree(good, cache)
        for _ in range(rng.randint(1, 3)):
            damage_file_at_random(cache / rng.choice(entries), rng)
        changed = [n for n in entries if (cache / n).read_bytes() != (good / n).read_bytes()]
        out = tmp_path / f"run{seed}"
        stdout = run_cli("sft", *two_source_args(tiny_model_dir, out, tmp_path, cache)).stdout
        context = f"seed {seed}: damaged {changed}\n{stdout[-3000:]}"
        reported = [line for line in stdout.splitlines() if "tokenizing the source again" in line]
        # Entries are reported in source order, not by name: compare them as sorted lists, which
        # still fails on an entry named twice or missed.
        named = sorted(line.split(": ")[0] for line in reported)
        assert named == [str(cache / n) for n in changed], context
        assert stdout.count("tokenized samples from the cache") == 2 - len(changed), context
        for name in entries:  # rebuilt as they were
            assert samples_in(cache / name) == samples_in(good / name), context
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), context
        for row, want in zip(rows, expected):
            for key in EXACT_KEYS:
                assert row[key] == want[key], (context, row["step"], key)


def share_soak_job(fixture, out):
    out.mkdir(parents=True, exist_ok=True)
    write_chats(out / "train.jsonl", 300)
    args = [str(fixture("tiny_model_dir")), str(out)]
    return {"call": f"{__name__}:sft_runs_with_random_damage_to_shares", "args": args}


def sft_runs_with_random_damage_to_shares(model_dir: str, out: str) -> None:
    """SOAK_SHARE_RUNS two-rank runs of `fnt sft`, each with a fresh cache; in run `seed` each
    rank damages its own share at random (a cut, a flipped bit, a zeroed 4 KiB block) right
    after writing it, with probability 0.6, and records whether the bytes changed."""
    import torch.distributed as dist

    import fnt.data.cache as cache_module
    from fnt.__main__ import main
    from tests.e2e.test_damaged_run_dirs import damage_file_at_random

    rank, root, write = dist.get_rank(), Path(out), cache_module.write_entry_
    for seed in range(SOAK_SHARE_RUNS):
        damages = random.Random(seed * 2 + rank)
        damaged = damages.random() < 0.6

        def write_then_damage(samples, path: Path) -> None:
            write(samples, path)
            if damaged and path.name.endswith(f".share{rank}.safetensors"):
                before = path.read_bytes()
                damage_file_at_random(path, damages)
                changed = path.read_bytes() != before
                (root / f"changed{seed}_{rank}").write_text(json.dumps(changed))

        cache_module.write_entry_ = write_then_damage
        try:
            data = root / "train.jsonl"
            args = sft_args(model_dir, root / f"run{seed}", data, "--max-steps", str(STEPS))
            main(["sft", *args, "--data.cache-dir", str(root / f"cache{seed}")])
        finally:
            cache_module.write_entry_ = write


@pytest.mark.slow
@pytest.mark.two_ranks(job=two_rank_job)
@pytest.mark.two_ranks(job=share_soak_job)
def test_soak_random_damage_to_the_shares_of_two_ranks_is_always_reported_and_rebuilt(
    two_rank_runs,
):
    """Every share whose bytes changed is named by rank 0 and tokenized again by the other
    rank, every run writes the undamaged run's entry and rows."""
    plain, soak = two_rank_runs(two_rank_job), two_rank_runs(share_soak_job)
    (plain_entry,) = (plain / "cache").iterdir()
    expected = read_metrics(plain / "run")
    log = (soak / "rank0.log").read_text().splitlines()
    damaged_runs = 0
    for seed in range(SOAK_SHARE_RUNS):
        (entry,) = (soak / f"cache{seed}").iterdir()
        changed = [
            r
            for r in (0, 1)
            if (soak / f"changed{seed}_{r}").is_file()
            and json.loads((soak / f"changed{seed}_{r}").read_text())
        ]
        damaged_runs += bool(changed)
        cache = soak / f"cache{seed}"
        reported = [x for x in log if x.startswith(f"{cache}/") and "share again" in x]
        shares = [entry.name.replace(".safetensors", f".share{r}.safetensors") for r in changed]
        assert [line.split(": ")[0] for line in reported] == [str(cache / n) for n in shares], (
            seed,
            reported,
        )
        assert without_dirs(samples_in(entry), soak) == without_dirs(
            samples_in(plain_entry), plain
        ), seed
        rows = read_metrics(soak / f"run{seed}")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), seed
        for row, want in zip(rows, expected):
            for key in EXACT_KEYS:
                assert row[key] == want[key], (seed, row["step"], key)
    assert damaged_runs >= SOAK_SHARE_RUNS // 2  # the seeds damage most runs
