"""What is on disk is checked before it is trusted: a damaged checkpoint is found by its
checksums (latest falls back to the newest one that verifies, an explicit step names the file),
a damaged or duplicated metrics row is reported and repaired, and a full disk, a dangling
symlink or a file as output_dir give one clear line."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fnt.store.rundir import ABANDONED_DIR, METRICS_FILE, METRICS_MISSING_FILE
from tests.e2e.helpers import (
    REPO,
    assert_resumed_run_matches,
    config_args,
    model_weights,
    read_metrics,
    run_cli,
    run_fnt,
)

STEPS = 8
EXACT_KEYS = ("loss/mean", "optim/grad_norm", "optim/lr", "progress/num_tokens")


def sft_args(model_dir, out: Path, *extra: str) -> tuple[str, ...]:
    return config_args(
        "examples/debug/sft.toml",
        model_dir,
        out,
        *("--max-steps", str(STEPS), "--ckpt.interval", "2", *extra),
    )


def zero_block(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(len(data[middle : middle + 4096]))
    path.write_bytes(bytes(data))


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGES = {"zeroed-4KiB": zero_block, "bit-flip": flip_bit, "truncated": truncate}


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("damage") / "full"
    run_cli("sft", *sft_args(tiny_model_dir, out))
    return out


def damaged_copy(full: Path, out: Path, file: str, damage) -> Path:
    """`full` as a run that went to step 8, with one file of step_8 damaged; the damaged path."""
    shutil.copytree(full, out)
    path = out / "checkpoints" / "step_8" / file
    damage(path)
    return path


@pytest.mark.numerics
@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
@pytest.mark.parametrize("file", ["__0_0.distcp", ".metadata", "progress.json"])
def test_resume_latest_falls_back_past_a_damaged_checkpoint_and_continues_exactly(
    tiny_model_dir, tmp_path, full_run, file, damage
):
    out = tmp_path / "run"
    path = damaged_copy(full_run, out, file, DAMAGES[damage])
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "latest"))
    lines = proc.stdout.splitlines()
    failed = [line for line in lines if "fails verification" in line]
    assert len(failed) == 1 and str(path) in failed[0], proc.stdout[-3000:]
    assert "resume: falling back to step_6, the newest checkpoint that verifies" in proc.stdout
    (moved,) = (out / "checkpoints" / ABANDONED_DIR).iterdir()
    assert [p.name for p in moved.iterdir()] == ["step_8"]
    assert_resumed_run_matches(full_run, out, 6, STEPS, EXACT_KEYS, tmp_path)


@pytest.mark.parametrize("file", ["config.json", "meta.json"])
def test_the_config_and_meta_files_of_a_checkpoint_are_covered_by_its_checksums(
    tiny_model_dir, tmp_path, full_run, file
):
    out = tmp_path / "run"
    path = damaged_copy(full_run, out, file, flip_bit)
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "latest"))
    assert (
        f"resume: checkpoint step_8 fails verification: {path}: contents differ from its "
        "recorded checksum (damaged on disk); moved it to "
    ) in proc.stdout, proc.stdout[-3000:]
    assert "resume: falling back to step_6, the newest checkpoint that verifies" in proc.stdout


def test_a_component_state_file_is_covered_by_the_checksums(tiny_model_dir, tmp_path):
    """An async RL run keeps the policies its rollouts still need in components/rollouts.pt."""
    out = tmp_path / "run"
    args = config_args(
        "examples/debug/rl.toml",
        tiny_model_dir,
        out,
        *("--max-steps", "4", "--ckpt.interval", "2", "--rollout.async-level", "1"),
    )
    run_cli("rl", *args)
    path = out / "checkpoints" / "step_4" / "components" / "rollouts.pt"
    flip_bit(path)
    proc = run_cli("rl", *args, "--max-steps", "5", "--resume", "latest")
    assert (
        f"resume: checkpoint step_4 fails verification: {path}: contents differ from its "
        "recorded checksum (damaged on disk); moved it to "
    ) in proc.stdout, proc.stdout[-3000:]
    assert "resume: falling back to step_2, the newest checkpoint that verifies" in proc.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_a_checkpoint_without_checksums_is_loaded_with_one_line_saying_so(
    tiny_model_dir, tmp_path, full_run
):
    """An fnt before checksums wrote no checksums.json: nothing to verify against, said once."""
    out = tmp_path / "run"
    shutil.copytree(full_run, out)
    (out / "checkpoints" / "step_8" / "checksums.json").unlink()
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "latest", "--max-steps", "9"))
    assert proc.stdout.count("unverified") == 1
    assert (
        f"resume: {out / 'checkpoints' / 'step_8'} records no checksums (an fnt before them "
        "wrote it): loaded unverified"
    ) in proc.stdout.splitlines()
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 10))


def test_resume_of_a_damaged_step_names_the_file_and_the_newest_good_step(
    tiny_model_dir, tmp_path, full_run
):
    out = tmp_path / "run"
    path = damaged_copy(full_run, out, "__0_0.distcp", flip_bit)
    zero_block(out / "checkpoints" / "step_6" / "__0_0.distcp")
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "8"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"error: resume = 8: checkpoint step_8 fails verification: {path}: contents differ "
        "from its recorded checksum (damaged on disk); the newest checkpoint that verifies is "
        "step_4 (--resume 4)"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_2",
        "step_4",
        "step_6",
        "step_8",
    ]  # nothing moved: the user chose the step


def test_when_no_checkpoint_verifies_resume_latest_says_so(tiny_model_dir, tmp_path, full_run):
    out = tmp_path / "run"
    damaged_copy(full_run, out, "progress.json", truncate)
    for step in (2, 4, 6):
        truncate(out / "checkpoints" / f"step_{step}" / "__0_0.distcp")
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "latest"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: resume = latest: no checkpoint in "), proc.stderr
    assert proc.stdout.count("fails verification") == 4


def test_without_verification_an_unreadable_checkpoint_is_named(tiny_model_dir, tmp_path, full_run):
    out = tmp_path / "run"
    damaged_copy(full_run, out, "__0_0.distcp", truncate)
    proc = run_cli(
        "sft",
        *sft_args(tiny_model_dir, out, "--resume", "latest", "--ckpt.verify", "false"),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"error: checkpoint {out / 'checkpoints' / 'step_8'} cannot be read")


def test_a_checkpoint_records_the_size_and_hash_of_every_file(full_run):
    step = full_run / "checkpoints" / "step_8"
    record = json.loads((step / "checksums.json").read_text())
    on_disk = sorted(
        p.relative_to(step).as_posix()
        for p in step.rglob("*")
        if p.is_file() and p.name not in ("COMPLETE", "checksums.json")
    )
    assert record["hash"] == "xxh3_128" and sorted(record["files"]) == on_disk
    assert {"__0_0.distcp", ".metadata", "progress.json", "config.json"} <= set(on_disk)
    for name, digest in record["files"].items():
        assert digest["bytes"] == (step / name).stat().st_size


@pytest.mark.slow
@pytest.mark.numerics
def test_at_two_ranks_a_damaged_shard_of_rank_1_falls_back_and_continues_exactly(
    tiny_model_dir, tmp_path
):
    full, out = tmp_path / "full", tmp_path / "run"
    run_fnt("sft", *sft_args(tiny_model_dir, full), nproc=2)
    path = damaged_copy(full, out, "__1_0.distcp", flip_bit)
    proc = run_fnt("sft", *sft_args(tiny_model_dir, out, "--resume", "latest"), nproc=2)
    assert f"{path}: contents differ from its recorded checksum" in proc.stdout, proc.stdout
    assert "falling back to step_6" in proc.stdout
    assert_resumed_run_matches(full, out, 6, STEPS, EXACT_KEYS, tmp_path)


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


def test_a_damaged_row_below_the_checkpoint_is_reported_and_recorded_as_missing(
    tiny_model_dir, tmp_path, full_run
):
    out = tmp_path / "run"
    shutil.copytree(full_run, out)
    metrics = out / METRICS_FILE
    lines = metrics.read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace('"', "", 1)  # row 3 loses a quote
    metrics.write_text("".join(lines))
    more = ("--max-steps", "10", "--resume", "latest")
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, *more))
    assert f"{metrics}:3: not a metrics row (invalid JSON at column 2" in proc.stdout
    assert f"steps 3 have no readable row; recorded as missing in {METRICS_MISSING_FILE}" in (
        proc.stdout
    )
    assert [r["step"] for r in read_metrics(out)] == [1, 2, *range(4, 11)]
    assert json.loads((out / METRICS_MISSING_FILE).read_text()) == {"missing_steps": [3]}
    shown = run_cli("inspect", str(out)).stdout
    assert "missing      no row for steps 3" in shown
    assert json.loads(run_cli("inspect", "--json", str(out)).stdout)["missing_steps"] == [3]


def test_duplicated_rows_are_named_by_inspect_and_a_resume_keeps_one_per_step(
    tiny_model_dir, tmp_path, full_run
):
    out = tmp_path / "run"
    shutil.copytree(full_run, out)
    metrics = out / METRICS_FILE
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:4] + lines[2:]))  # rows 1,2,3,4,3,4,5..8
    assert "duplicated   steps 3..4 have more than one row" in run_cli("inspect", str(out)).stdout
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--max-steps", "10", "--resume", "8"))
    assert f"{metrics}: step 3 has 2 rows (lines 3, 5); kept the last" in proc.stdout
    assert f"{metrics}: step 4 has 2 rows (lines 4, 6); kept the last" in proc.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 11))
    summary = json.loads(run_cli("inspect", "--json", str(out)).stdout)
    assert summary["duplicated_steps"] == [] and summary["missing_steps"] == []


# ---------------------------------------------------------------------------------------------
# output_dir and the disk


def test_a_dangling_symlink_output_dir_is_created_through_the_link(tiny_model_dir, tmp_path):
    link, target = tmp_path / "link", tmp_path / "elsewhere" / "run"
    link.symlink_to(target)
    run_cli("sft", *sft_args(tiny_model_dir, link, "--max-steps", "2"))
    assert link.is_symlink() and [r["step"] for r in read_metrics(target)] == [1, 2]


def test_an_output_dir_that_is_a_file_is_one_line(tiny_model_dir, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    proc = run_cli("sft", *sft_args(tiny_model_dir, path), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: 'output_dir' = {str(path)!r}: is a file, not a directory: choose another "
        "output_dir"
    )


@pytest.mark.slow
def test_a_full_disk_during_a_save_names_enospc_and_keeps_the_last_checkpoint(
    tiny_model_dir, tmp_path
):
    """On a 2 MiB tmpfs (mounted in a user namespace of its own) step_1 fits, step_2 does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = sft_args(tiny_model_dir, disk / "run", "--max-steps", "4", "--ckpt.interval", "1")
    quoted = " ".join(f"'{a}'" for a in args)
    # The tmpfs goes with the namespace: what the run left is listed before the shell ends.
    script = (
        f"mount -t tmpfs -o size=2m none '{disk}' || exit 99; "
        f"'{sys.executable}' -m fnt sft {quoted} > '{tmp_path}/out' 2> '{tmp_path}/err'; "
        f"code=$?; ls '{disk}/run/checkpoints' > '{tmp_path}/ls'; exit $code"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, timeout=120)
    stderr = (tmp_path / "err").read_text()
    assert done.returncode == 2, stderr[-3000:]
    assert (tmp_path / "ls").read_text().split() == ["step_1", "step_2.partial"]
    (line,) = stderr.strip().splitlines()
    assert line.startswith(
        f"error: saving checkpoint step_2 failed: no space left on device (ENOSPC) in "
        f"{disk / 'run' / 'checkpoints'}, "
    ), line
    assert line.endswith("(OSError: [Errno 28] No space left on device)"), line


# ---------------------------------------------------------------------------------------------
# Soak: random damage


def damage_file_at_random(path: Path, rng: random.Random) -> bool:
    """Truncate, flip one bit or zero a 4 KiB block of `path` at a random place; whether its
    bytes changed (zeroing zeros changes nothing)."""
    data = bytearray(path.read_bytes())
    kind = rng.choice(["truncate", "flip", "zero"])
    if kind == "truncate":
        del data[rng.randrange(len(data)) :]
    elif kind == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        start = rng.randrange(len(data))
        data[start : start + 4096] = bytes(len(data[start : start + 4096]))
    changed = bytes(data) != path.read_bytes()
    path.write_bytes(bytes(data))
    return changed


def damage_row_at_random(lines: list[str], rng: random.Random) -> tuple[list[str], str]:
    """One row of metrics.jsonl made unreadable (a quote dropped, cut short, zeroed) or
    duplicated; the new lines and what was done."""
    index = rng.randrange(len(lines))
    line = lines[index]
    kind = rng.choice(["quote", "cut", "zeros", "duplicate"])
    if kind == "duplicate":
        return lines[: index + 1] + [line] + lines[index + 1 :], kind
    if kind == "quote":
        quotes = [i for i, c in enumerate(line) if c == '"']
        spoiled = line[: (i := rng.choice(quotes))] + line[i + 1 :]
    elif kind == "cut":
        spoiled = line[: rng.randrange(1, len(line) - 1)] + "\n"
    else:
        spoiled = "\0" * (len(line) - 1) + "\n"
    return lines[:index] + [spoiled] + lines[index + 1 :], kind


@pytest.mark.slow
@pytest.mark.numerics
def test_soak_random_damage_to_checkpoints_and_rows_never_goes_unnoticed(
    tiny_model_dir, tmp_path, full_run
):
    """20 copies of a finished 8-step run (checkpoints at 2, 4, 6, 8), each with 1 to 3 random
    damages to checkpoint files and metrics rows, resumed with --resume latest: each resumes
    from the newest checkpoint left undamaged, saying so, or exits 2 when none is; the rows end
    as 1..8 once, equal to the undamaged run's, but for the rows below the resume point that
    could not be read, which metrics_missing.json records."""
    full_rows = {r["step"]: r for r in read_metrics(full_run)}
    for seed in range(20):
        rng = random.Random(seed)
        out = tmp_path / f"run{seed}"
        shutil.copytree(full_run, out)
        damaged_steps = set()
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6:
                step = rng.choice([2, 4, 6, 8])
                directory = out / "checkpoints" / f"step_{step}"
                files = sorted(p for p in directory.rglob("*") if p.is_file())
                target = rng.choice([p for p in files if p.name != "COMPLETE"])
                if damage_file_at_random(target, rng):
                    damaged_steps.add(step)
            else:
                metrics = out / METRICS_FILE
                lines, _ = damage_row_at_random(metrics.read_text().splitlines(True), rng)
                metrics.write_text("".join(lines))
        readable = readable_steps((out / METRICS_FILE).read_text().splitlines())
        good = [s for s in (8, 6, 4, 2) if s not in damaged_steps]
        proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--resume", "latest"), check=False)
        context = f"seed {seed}: damaged steps {sorted(damaged_steps)}\n{proc.stdout[-3000:]}"
        assert proc.stdout.count("fails verification") == len(
            [s for s in damaged_steps if not good or s > good[0]]
        ), context
        if not good:
            assert proc.returncode == 2 and "no checkpoint in" in proc.stderr, context
            continue
        assert proc.returncode == 0, context + proc.stderr[-3000:]
        start = good[0]
        assert (f"falling back to step_{start}" in proc.stdout) == (start != 8), context
        rows = {r["step"]: r for r in read_metrics(out)}
        missing = [s for s in range(1, start + 1) if s not in readable]
        assert sorted(rows) == [s for s in range(1, 9) if s not in missing], context
        if missing:
            recorded = json.loads((out / METRICS_MISSING_FILE).read_text())
            assert recorded == {"missing_steps": missing}, context
        else:
            assert not (out / METRICS_MISSING_FILE).exists(), context
        for step, row in rows.items():
            for key in EXACT_KEYS:
                assert row[key] == full_rows[step][key], (context, step, key)
        assert_resumed_run_matches_weights(full_run, out, tmp_path)


def readable_steps(lines: list[str]) -> set[int]:
    """The steps of the lines that parse as a JSON object with an integer step."""
    steps = set()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and type(row.get("step")) is int:
            steps.add(row["step"])
    return steps


def assert_resumed_run_matches_weights(full: Path, resumed: Path, tmp_path: Path) -> None:
    w_full = model_weights(full / "checkpoints" / "step_8", tmp_path)
    w_resumed = model_weights(resumed / "checkpoints" / "step_8", tmp_path)
    for name in w_full:
        assert torch.equal(w_full[name], w_resumed[name]), name
