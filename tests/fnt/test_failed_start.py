"""The rules of undoing a failed start (fnt.store.failed_start), and the run lock's use of them:
what a start created is removed, what was there stays, a directory that held anything is not
touched once the start has changed it, and nothing is undone once the first row is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from fnt.store.failed_start import record_start, undo_start_
from fnt.store.rundir import LOCK_FILE, run_lock, start_changing, start_done

OWN = ("run.lock", "config.json", "metrics.jsonl", "data_cache", "checkpoints")
KEEP = ("rollouts",)


def files(root: Path) -> dict[str, str | None]:
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_text()
        for p in sorted(root.rglob("*"))
    }


def write(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"written by the start: {name}\n")


def test_a_new_directory_goes_with_the_parents_made_for_it(tmp_path):
    out = tmp_path / "runs" / "a" / "b"
    record = record_start(out, "run.lock", OWN, KEEP)
    assert record.created == tmp_path / "runs"
    write(out, "run.lock", "data_cache/x/tokens.bin", "metrics.jsonl", "trace/trace_0.json.gz")
    undo_start_(record)
    assert list(tmp_path.iterdir()) == []


def test_a_new_directory_keeps_what_another_process_wrote(tmp_path):
    out = tmp_path / "run"
    record = record_start(out, "run.lock", OWN, KEEP)
    write(out, "run.lock", "config.json", "rollouts/step_1/samples.jsonl")
    undo_start_(record)
    assert sorted(files(out)) == ["rollouts", "rollouts/step_1", "rollouts/step_1/samples.jsonl"]


def test_an_existing_directory_gets_back_its_entries_and_lock_text(tmp_path):
    out = tmp_path / "run"
    write(out, "slurm-1.out", "data_cache/old/tokens.bin", "checkpoints/step_2/COMPLETE")
    (out / "run.lock").write_text("host a pid 1\n")
    before = files(out)
    record = record_start(out, "run.lock", OWN, KEEP)
    (out / "run.lock").write_text("host b pid 2\n")
    write(out, "data_cache/new/tokens.bin", "metrics.jsonl", "rollouts/step_3/samples.jsonl")
    write(out, "scheduler.log")  # not a name the run writes: another program's, left alone
    undo_start_(record)
    after = files(out)
    assert after.pop("scheduler.log") is not None
    assert after.pop("rollouts/step_3/samples.jsonl") is not None
    assert {k: v for k, v in after.items() if not k.startswith("rollouts")} == before


@pytest.mark.parametrize("held", ["nothing", "a run"])
def test_once_the_start_changes_a_directory_that_held_a_run_it_is_left_as_it_is(tmp_path, held):
    out = tmp_path / "run"
    out.mkdir()
    if held == "a run":
        write(out, "checkpoints/step_2/COMPLETE")
    record = record_start(out, "run.lock", OWN, KEEP)
    record.changing = True
    write(out, "run.lock", "config.json")
    undo_start_(record)
    assert ("config.json" in files(out)) == (held == "a run")


def test_nothing_is_undone_once_the_first_row_is_written(tmp_path):
    out = tmp_path / "run"
    record = record_start(out, "run.lock", OWN, KEEP)
    record.done = True
    write(out, "run.lock", "metrics.jsonl")
    undo_start_(record)
    assert sorted(files(out)) == ["metrics.jsonl", "run.lock"]


def test_the_run_lock_undoes_on_an_exception_before_the_first_row_only(tmp_path):
    out = tmp_path / "runs" / "x"
    with pytest.raises(KeyError):
        with run_lock(out):
            write(out, "data_cache/x/tokens.bin")
            with run_lock(out):  # the driver's, nested in the command line's: the outer undoes
                raise KeyError("failed")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(KeyError):
        with run_lock(out):
            start_changing(out)
            write(out, "metrics.jsonl")
            start_done(out)
            raise KeyError("failed in step 2")
    assert sorted(files(out)) == ["metrics.jsonl", LOCK_FILE]
