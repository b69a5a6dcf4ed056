"""Checkpoint decisions: when to save, what to delete, and cleanup and the fork's move aside on a
real directory."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.checkpoint import should_checkpoint
from fnt.resume import resolve_resume_step
from fnt.store.rundir import (
    ABANDONED_DIR,
    ABANDONED_KEEP,
    COMPLETE_MARKER,
    abandon_newer_,
    prune_abandoned_,
    prune_steps_,
    steps_to_delete,
)

SETTINGS = settings(max_examples=200, deadline=None)
FS_SETTINGS = settings(max_examples=100, deadline=None)
TMP_BASE = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
STEPS = st.integers(min_value=0, max_value=60)


# ---------------------------------------------------------------------------------------------
# should_checkpoint


@SETTINGS
@given(interval=st.integers(0, 12), max_steps=st.integers(1, 60), save_final=st.booleans())
def test_saved_steps_are_the_interval_multiples_and_the_final_step(interval, max_steps, save_final):
    saved = [
        s for s in range(1, max_steps + 1) if should_checkpoint(s, interval, max_steps, save_final)
    ]
    expected = {s for s in range(1, max_steps + 1) if interval > 0 and s % interval == 0}
    if save_final:
        expected.add(max_steps)
    assert saved == sorted(expected)
    # The final step is saved at most once, and exactly once when save_final is set.
    assert saved.count(max_steps) == (1 if max_steps in expected else 0)


def test_should_checkpoint_examples():
    assert should_checkpoint(10, 0, 10, True)
    assert not should_checkpoint(10, 0, 10, False)
    assert should_checkpoint(10, 5, 10, False)
    assert not should_checkpoint(9, 5, 10, True)
    assert should_checkpoint(5, 5, 10, False)
    assert not should_checkpoint(5, 0, 10, True)


# ---------------------------------------------------------------------------------------------
# steps_to_delete


@SETTINGS
@given(st.lists(STEPS, unique=True, max_size=10), st.integers(-2, 12))
def test_steps_to_delete_keeps_the_newest(steps, keep_last):
    doomed = steps_to_delete(steps, keep_last)
    kept = sorted(set(steps) - set(doomed))
    assert set(doomed) <= set(steps)
    assert len(doomed) == len(set(doomed))
    if keep_last <= 0:
        assert doomed == []
        return
    assert len(kept) == min(len(steps), keep_last)
    if steps:
        assert max(steps) in kept
    if doomed and kept:
        assert max(doomed) < min(kept)


def test_steps_to_delete_examples():
    assert steps_to_delete([3, 1, 2, 5], 2) == [1, 2]
    assert steps_to_delete([3, 1, 2, 5], 0) == []
    assert steps_to_delete([3, 1, 2, 5], 4) == []
    assert steps_to_delete([7], 1) == []
    assert steps_to_delete([], 3) == []


# ---------------------------------------------------------------------------------------------
# prune_steps_ on a real directory

UNRELATED = ["foo", "step_x", "step_-1", "step_", "step_3_old", "step_3.bak", "latest", "notes.txt"]


@st.composite
def listings(draw):
    complete = draw(st.sets(STEPS, max_size=7))
    unmarked = draw(st.sets(STEPS, max_size=4)) - complete
    partial = draw(st.sets(STEPS, max_size=3))
    unrelated = draw(
        st.lists(
            st.tuples(st.sampled_from(UNRELATED), st.sampled_from(["dir", "marked", "file"])),
            unique_by=lambda t: t[0],
            max_size=4,
        )
    )
    return complete, unmarked, partial, unrelated


def build(root: Path, listing) -> None:
    complete, unmarked, partial, unrelated = listing
    root.mkdir(parents=True)
    for n in complete:
        (root / f"step_{n}").mkdir()
        (root / f"step_{n}" / "progress.json").write_text("{}")
        (root / f"step_{n}" / COMPLETE_MARKER).write_text(f"step {n}\n")
    for n in unmarked:
        (root / f"step_{n}").mkdir()
        (root / f"step_{n}" / "progress.json").write_text("{}")
    for n in partial:
        (root / f"step_{n}.partial").mkdir()
        (root / f"step_{n}.partial" / COMPLETE_MARKER).write_text(f"step {n}\n")
    for name, kind in unrelated:
        if kind == "file":
            (root / name).write_text("x")
        else:
            (root / name).mkdir()
            if kind == "marked":
                (root / name / COMPLETE_MARKER).write_text("x")


def snapshot(root: Path) -> set[str]:
    """Every path under root, relative, so 'untouched' can be checked exactly."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@FS_SETTINGS
@given(listings(), st.integers(0, 8))
def test_cleanup_deletes_only_old_complete_checkpoints_and_unmarked_leftovers(listing, keep_last):
    complete, unmarked, _, _ = listing
    with tempfile.TemporaryDirectory(dir=TMP_BASE) as tmp:
        root = Path(tmp) / "checkpoints"
        build(root, listing)
        before = snapshot(root)
        latest_before = resolve_resume_step("latest", root)

        deleted = prune_steps_(root, keep_last)

        newest_first = sorted(complete, reverse=True)
        expected_deleted = [] if keep_last == 0 else newest_first[keep_last:]
        # An unmarked step_N is what a delete interrupted after the marker leaves behind.
        assert deleted == sorted([*expected_deleted, *unmarked])
        removed = {p for p in before if p.split("/")[0] in {f"step_{n}" for n in deleted}}
        assert snapshot(root) == before - removed
        assert resolve_resume_step("latest", root) == latest_before
        if complete:
            assert (root / f"step_{max(complete)}" / COMPLETE_MARKER).is_file()


def test_cleanup_of_a_missing_directory(tmp_path):
    assert prune_steps_(tmp_path / "nothing", 2) == []


def test_cleanup_ignores_non_canonical_names(tmp_path):
    """`step_01` was not written by fnt: cleanup must leave it alone and must not crash on it."""
    root = tmp_path / "checkpoints"
    for name in ["step_01", "step_5", "step_6"]:
        (root / name).mkdir(parents=True)
        (root / name / COMPLETE_MARKER).write_text("x")
    deleted = prune_steps_(root, 2)
    assert deleted == []
    assert sorted(p.name for p in root.iterdir()) == ["step_01", "step_5", "step_6"]


# ---------------------------------------------------------------------------------------------
# abandon_newer_ on a real directory


@FS_SETTINGS
@given(listings(), STEPS)
def test_abandon_moves_newer_checkpoints_and_partials_aside_intact(listing, start):
    complete, _, partial, _ = listing
    with tempfile.TemporaryDirectory(dir=TMP_BASE) as tmp:
        root = Path(tmp) / "checkpoints"
        build(root, listing)
        before = snapshot(root)

        moves = abandon_newer_(root, start)

        newer = {f"step_{n}" for n in complete if n > start}
        moved = newer | {f"step_{n}.partial" for n in partial}
        assert {source.name for source, _ in moves} == moved
        stamps = {target.parent for _, target in moves}
        assert len(stamps) <= 1 and all(t.parent == root / ABANDONED_DIR for t in stamps)
        after = snapshot(root)
        kept = {p for p in after if p.split("/")[0] != ABANDONED_DIR}
        assert kept == {p for p in before if p.split("/")[0] not in moved}
        for source, target in moves:
            # Kept as it was, marker included: the old trajectory can still be inspected.
            assert snapshot(target) == {
                p.split("/", 1)[1] for p in before if p.split("/")[0] == source.name and "/" in p
            }
        latest = resolve_resume_step("latest", root)
        assert latest == max((n for n in complete if n <= start), default=None)


def test_abandon_twice_keeps_both_forks(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ["step_2", "step_4"]:
        (root / name).mkdir(parents=True)
        (root / name / COMPLETE_MARKER).write_text("x")
    assert [s.name for s, _ in abandon_newer_(root, 2)] == ["step_4"]
    (root / "step_4").mkdir()
    (root / "step_4" / COMPLETE_MARKER).write_text("y")
    assert [s.name for s, _ in abandon_newer_(root, 2)] == ["step_4"]
    assert abandon_newer_(root, 2) == []
    forks = sorted((root / ABANDONED_DIR).iterdir())
    assert [(f / "step_4" / COMPLETE_MARKER).read_text() for f in forks] == ["x", "y"]


def test_only_the_newest_abandoned_folders_are_kept(tmp_path):
    root = tmp_path / "checkpoints"
    stamps = []
    for n in range(ABANDONED_KEEP + 2):
        (root / f"step_{n}.partial").mkdir(parents=True)  # a save a kill interrupted
        ((_, target),) = abandon_newer_(root, 0)
        stamps.append(target.parent.name)
    (root / ABANDONED_DIR / "notes.txt").write_text("a user's file is not a fork")
    deleted = prune_abandoned_(root)
    assert [p.name for p in deleted] == stamps[:2]
    left = sorted(p.name for p in (root / ABANDONED_DIR).iterdir())
    assert left == sorted(stamps[2:] + ["notes.txt"])
    assert prune_abandoned_(root) == []
    assert prune_abandoned_(tmp_path / "nowhere") == []


def test_a_start_prunes_abandoned_folders(tiny_model_dir, tmp_path):
    from tests.e2e.helpers import config_args, run_cli

    out = tmp_path / "run"
    args = config_args("examples/debug/sft.toml", tiny_model_dir, out, "--ckpt.interval", "1")
    run_cli("sft", *args, "--max-steps", "2")
    for _ in range(ABANDONED_KEEP + 1):  # each resume at step 1 forks: step_2 is moved aside
        run_cli("sft", *args, "--max-steps", "2", "--resume", "1")
    assert len(list((out / "checkpoints" / ABANDONED_DIR).iterdir())) == ABANDONED_KEEP
