"""Resume rules over random checkpoint directories, built for real on disk, and the
reconciliation of a checkpoint's config with the current one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.config import DataSourceConfig, DPOConfig, RLConfig, all_keys, load_config, to_plain
from fnt.obs.monitors.jsonl import repair_metrics_
from fnt.resume import (
    FIXED,
    LAUNCH,
    POLICY_MEANINGS,
    RESUME_POLICY,
    ResumeError,
    choose_resume_step,
    override_lines,
    reconcile_config,
    refusal,
    resolve_resume_step,
)
from fnt.store.rundir import (
    ABANDONED_DIR,
    COMPLETE_MARKER,
    abandoned_names,
    complete_steps,
    list_step_dirs,
    run_steps,
    step_dir,
    step_of,
)
from fnt.testing.strategies import STEPS, UNRELATED, checkpoint_listings, write_listing_

SETTINGS = settings(max_examples=100, deadline=None)
FS_SETTINGS = settings(max_examples=100, deadline=None)
# Hypothesis builds many small trees; a RAM-backed directory keeps that fast where there is one.
TMP_BASE = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@FS_SETTINGS
@given(checkpoint_listings())
def test_resolve_over_random_directories(listing):
    with tempfile.TemporaryDirectory(dir=TMP_BASE) as tmp:
        root = Path(tmp) / "checkpoints"
        write_listing_(root, listing)
        assert sorted(complete_steps(list_step_dirs(root))) == sorted(listing["complete"])

        latest = resolve_resume_step("latest", root)
        assert latest == (max(listing["complete"]) if listing["complete"] else None)
        if latest is not None:
            assert (step_dir(root, latest) / COMPLETE_MARKER).is_file()
        assert resolve_resume_step(True, root) == latest
        assert resolve_resume_step(None, root) is None
        assert resolve_resume_step(False, root) is None

        candidates = (
            listing["complete"]
            | listing["unmarked"]
            | listing["partial"]
            | listing["as_file"]
            | listing["marker_is_dir"]
            | {-1, 61}
        )
        for n in sorted(candidates):
            if n in listing["complete"]:
                assert resolve_resume_step(n, root) == n
                continue
            with pytest.raises(ResumeError) as info:
                resolve_resume_step(n, root)
            msg = str(info.value)
            assert f"step_{n}" in msg
            listed = msg.split("found", 1)[1]
            assert sorted(int(x) for x in re.findall(r"\d+", listed)) == sorted(
                listing["complete"]
            ), msg


def test_missing_directory(tmp_path):
    root = tmp_path / "never_created"
    assert list_step_dirs(root) == []
    assert resolve_resume_step("latest", root) is None
    assert resolve_resume_step(None, root) is None
    with pytest.raises(ResumeError, match=r"step_3.*none"):
        resolve_resume_step(3, root)


def test_canonical_name_only(tmp_path):
    """Only the name the saver writes, `step_{N}`, is a checkpoint: `step_01` is not step 1.

    Otherwise "latest" picks a step whose `step_dir(root, step)` does not exist.
    """
    root = tmp_path / "checkpoints"
    (root / "step_01").mkdir(parents=True)
    (root / "step_01" / COMPLETE_MARKER).write_text("x")
    (root / "step_007").mkdir()
    (root / "step_007" / COMPLETE_MARKER).write_text("x")
    step = resolve_resume_step("latest", root)
    assert step is None or (step_dir(root, step) / COMPLETE_MARKER).is_file()


# ---------------------------------------------------------------------------------------------
# The pure rules


listing_entries = st.lists(
    st.tuples(
        st.one_of(
            STEPS.map(lambda n: f"step_{n}"),
            STEPS.map(lambda n: f"step_{n}.partial"),
            st.sampled_from(UNRELATED),
            st.text(alphabet="abcepstx_.-", max_size=8),
        ),
        st.booleans(),
    ),
    max_size=12,
)


@SETTINGS
@given(listing_entries)
def test_complete_steps_keeps_marked_step_dirs_only(entries):
    steps = complete_steps(entries)
    assert steps == sorted(steps)
    expected = sorted(
        int(name[5:])
        for name, marked in entries
        if marked and re.fullmatch(r"step_(0|[1-9][0-9]*)", name)
    )
    assert steps == expected


@SETTINGS
# A directory listing names each entry once.
@given(listing_entries.map(lambda entries: list(dict(entries).items())), STEPS)
def test_abandoned_names_leave_one_trajectory_up_to_the_start(entries, start):
    moved = abandoned_names(entries, start)
    assert moved == sorted(set(moved))
    assert set(moved) <= {name for name, _ in entries}
    rest = [(name, marked) for name, marked in entries if name not in moved]
    # What stays holds exactly the complete checkpoints up to the start, and no unfinished save.
    assert complete_steps(rest) == [s for s in complete_steps(entries) if s <= start]
    assert not any(re.fullmatch(r"step_(0|[1-9][0-9]*)\.partial", name) for name, _ in rest)
    # Nothing else is touched: every moved name is a newer complete step or a partial.
    for name in moved:
        step = step_of(name.removesuffix(".partial"))
        assert step is not None
        assert name.endswith(".partial") or step > start


def test_abandoned_names_examples():
    entries = [
        ("step_2", True),
        ("step_4", True),
        ("step_6", True),
        ("step_5", False),
        ("step_3.partial", True),
        ("step_x.partial", False),
        (ABANDONED_DIR, False),
    ]
    assert abandoned_names(entries, 2) == ["step_3.partial", "step_4", "step_6"]
    assert abandoned_names(entries, 6) == ["step_3.partial"]


def test_resolve_ignores_abandoned_checkpoints(tmp_path):
    """The checkpoints a fork moved aside keep their markers and must never be resumed."""
    root = tmp_path / "checkpoints"
    for path in [root / "step_2", root / ABANDONED_DIR / "t" / "step_9"]:
        path.mkdir(parents=True)
        (path / COMPLETE_MARKER).write_text("x")
    (root / ABANDONED_DIR / COMPLETE_MARKER).write_text("x")
    assert complete_steps(list_step_dirs(root)) == [2]
    assert resolve_resume_step("latest", root) == 2


@SETTINGS
@given(st.lists(STEPS, unique=True, max_size=8).map(sorted), st.one_of(STEPS, st.integers(-5, -1)))
def test_choose_resume_step(steps, n):
    assert choose_resume_step(None, steps) is None
    assert choose_resume_step(False, steps) is None
    latest = max(steps) if steps else None
    assert choose_resume_step("latest", steps) == latest
    assert choose_resume_step(True, steps) == latest
    if n in steps:
        assert choose_resume_step(n, steps) == n
    else:
        with pytest.raises(ResumeError) as info:
            choose_resume_step(n, steps)
        msg = str(info.value)
        assert f"step_{n}" in msg
        found = msg.split("found", 1)[1]
        assert [int(x) for x in re.findall(r"\d+", found)] == steps


@pytest.mark.parametrize("resume", ["earliest", "3", 2.0, [1]])
def test_choose_rejects_other_values(resume):
    with pytest.raises(ResumeError):
        choose_resume_step(resume, [1, 2, 3])


def test_step_of():
    assert step_of("step_0") == 0
    assert step_of("step_12") == 12
    for name in ["step_", "step_x", "step_-1", "step_3.partial", "xstep_3", "step_3 ", "Step_3"]:
        assert step_of(name) is None, name


@pytest.mark.parametrize("name", ["step_01", "step_007", "step_3\n", "step_\u0661"])
def test_step_of_rejects_names_the_saver_never_writes(name):
    """`step_dir(root, step_of(name))` must be `root / name`, or the rules pick a ghost."""
    step = step_of(name)
    assert step is None or f"step_{step}" == name


# Reconciling the checkpoint's config with the current one ---------------------------------


def test_every_schema_key_has_a_resume_policy():
    """A key added to the schema without a decision here must fail, not default silently."""
    schema = set(all_keys(RLConfig)) | set(all_keys(DPOConfig))
    assert schema - set(RESUME_POLICY) == set(), "add these keys to fnt.resume.RESUME_POLICY"
    assert set(RESUME_POLICY) - schema == set(), "these keys are no longer in the schema"
    assert set(RESUME_POLICY.values()) <= set(POLICY_MEANINGS)


def nested(flat: dict) -> dict:
    """`{"a.b": 1}` -> `{"a": {"b": 1}}`, the shape of a config's plain dict."""
    out: dict = {}
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return out


VALUES = st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b", None, True]), st.just([1, 2]))


@st.composite
def config_pairs(draw):
    """A saved and a current config over the schema's keys: some equal, some changed, some keys
    unknown to the checkpoint (it was written before they existed)."""
    current, saved = {}, {}
    for key in RESUME_POLICY:
        current[key] = draw(VALUES)
        kind = draw(st.sampled_from(["same", "same", "changed", "absent"]))
        if kind == "same":
            saved[key] = current[key]
        elif kind == "changed":
            # A value that differs from the current one (mapped, not filtered: with ~140 keys,
            # filtering rejects too many examples).
            saved[key] = draw(VALUES.map(lambda v, new=current[key]: v if v != new else [new]))
    return saved, current


@settings(max_examples=30, deadline=None)
@given(config_pairs(), st.booleans())
def test_reconcile_config_follows_the_policy_of_each_key(pair, force):
    saved, current = pair
    decisions = reconcile_config(nested(saved), nested(current), force=force)
    assert set(decisions) == set(current)
    for key, decision in decisions.items():
        policy = RESUME_POLICY[key]
        assert decision.new == current[key]
        changed = key in saved and saved[key] != current[key] and policy != LAUNCH
        if not changed:
            assert decision.action == "keep", key
        elif policy == FIXED and not force:
            assert decision.action == "refuse", key
        else:
            assert decision.action == "override", key
            assert decision.forced == (policy == FIXED)
        if changed:
            assert decision.old == saved[key]
    refused = [k for k, d in decisions.items() if d.action == "refuse"]
    message = refusal(decisions, "ckpt/step_3")
    if refused:
        assert "\n" not in message and "--resume.force" in message
        for key in refused:
            assert f"{key}: {json.dumps(saved[key])} -> {json.dumps(current[key])}" in message
    else:
        assert message is None
    overridden = [k for k, d in decisions.items() if d.action == "override"]
    lines = override_lines(decisions)
    assert len(lines) == len(overridden)
    assert all(line.startswith(f"resume: {key}: ") for line, key in zip(lines, overridden))
    # Resuming with the checkpoint's own config has nothing to reconcile.
    same = reconcile_config(nested(current), nested(current), force=force)
    assert {d.action for d in same.values()} == {"keep"}


def test_reconcile_real_configs():
    saved = RLConfig()
    current = dataclasses.replace(
        saved,
        seed=1,
        max_steps=50,
        resume="latest",
        optim=dataclasses.replace(saved.optim, weight_decay=0.1, betas=(0.8, 0.99)),
        data=dataclasses.replace(
            saved.data, kind="sources", sources=(DataSourceConfig(path="a.jsonl"),)
        ),
    )
    decisions = reconcile_config(to_plain(saved), to_plain(current))
    actions = {k: d.action for k, d in decisions.items() if d.action != "keep"}
    assert actions == {
        "seed": "refuse",
        "data.kind": "refuse",
        "data.sources": "refuse",
        "max_steps": "override",
        "optim.weight_decay": "override",
        "optim.betas": "override",
    }
    message = refusal(decisions, "run/checkpoints/step_2")
    assert message.startswith("resume from run/checkpoints/step_2: ")
    assert 'seed: 0 -> 1; data.kind: "synthetic" -> "sources"; data.sources: [] -> [{' in message
    assert override_lines(decisions) == [
        "resume: max_steps: 10 -> 50",
        "resume: optim.betas: [0.9, 0.999] -> [0.8, 0.99]",
        "resume: optim.weight_decay: 0.0 -> 0.1",
    ]
    forced = reconcile_config(to_plain(saved), to_plain(current), force=True)
    assert refusal(forced, "x") is None
    assert "resume: seed: 0 -> 1 (a fixed key, forced by --resume.force)" in override_lines(forced)


@pytest.mark.parametrize(
    ("argv", "force"),
    [
        (["--resume", "latest", "--resume.force"], True),
        (["--resume.force", "--resume", "2"], True),
        (["--resume.force=false"], False),
        (["--resume-force", "true"], True),
        ([], False),
    ],
)
def test_resume_force_on_the_command_line(argv, force):
    config, _ = load_config(argv)
    assert config.resume_force is force


def test_run_steps_counts_every_step_directory():
    entries = [
        ("step_0", True),
        ("step_3", False),
        ("step_4.partial", False),
        ("step_x", True),
        (ABANDONED_DIR, False),
        ("samples.jsonl", False),
    ]
    assert run_steps(entries) == [0, 3, 4]


def test_the_metrics_trim_is_written_fsynced_and_renamed_then_the_directory_fsynced(
    tmp_path, monkeypatch
):
    """A crash or power loss during the trim on resume must leave the old rows or the trimmed
    ones, durable: the kept rows are fsynced before the rename, the directory after it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"st')
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, target):
        events.append(("replace", str(source), str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    repair_metrics_(path, 3)
    tmp = str(tmp_path / "metrics.jsonl.tmp")
    assert events == [("fsync", tmp), ("replace", tmp, str(path)), ("fsync", str(tmp_path))]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
