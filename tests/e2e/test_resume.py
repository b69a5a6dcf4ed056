"""Resume is exact and checkpoints are transactions: real runs, real crashes."""

from __future__ import annotations

import shutil

import pytest

from fnt.monitors import read_metrics
from fnt.resume import ABANDONED_DIR, resolve_resume_step
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    run_killed,
    run_script,
)

N, K = 6, 3
EXACT_KEYS = (
    "loss/mean",
    "optim/grad_norm",
    "optim/lr",
    "progress/num_samples",
    "progress/num_tokens",
)


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


@pytest.mark.parametrize("nproc", [0, 2], ids=["1rank", "2ranks"])
def test_k_steps_then_resume_equals_n_steps(tiny_model_dir, tmp_path, nproc):
    full = tmp_path / "full"
    run_script("sft.py", *args(tiny_model_dir, full, "--ckpt.interval", str(K)), nproc=nproc)

    # A crashed run: its checkpoint at K, and metrics rows it had written beyond K.
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    run_script("sft.py", *args(tiny_model_dir, resumed, "--resume", "latest"), nproc=nproc)
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)


@pytest.mark.parametrize("phase", ["shards", "marker"])
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(
    tiny_model_dir, tmp_path, phase
):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out, "--ckpt.interval", "2"), fault=f"{phase}@4")
    assert (out / "checkpoints" / "step_4.partial").is_dir()  # the save really was under way
    assert resolve_resume_step("latest", out / "checkpoints") == 2

    run_script("sft.py", *args(tiny_model_dir, out, "--ckpt.interval", "2", "--resume", "latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    assert resolve_resume_step("latest", out / "checkpoints") == N
    assert not (out / "checkpoints" / "step_4.partial").exists()


KEEP_ONE = ("--ckpt.interval", "2", "--ckpt.keep-last", "1")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_script("sft.py", *args(tiny_model_dir, out, *KEEP_ONE))
    return out


@pytest.mark.parametrize(
    "fault",
    # Right after step_4's rename; and while the cleanup after that save deletes step_2.
    ["committed@4", "cleanup@2"],
)
def test_sigkill_after_a_commit_keeps_every_row_exactly_once(
    tiny_model_dir, tmp_path, uninterrupted, fault
):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out, *KEEP_ONE), fault=fault)
    # step_4 is complete, so its row must be there already: nothing would ever write it again.
    assert resolve_resume_step("latest", out / "checkpoints") == 4
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]

    run_script("sft.py", *args(tiny_model_dir, out, *KEEP_ONE, "--resume", "latest"))
    # The interrupted delete of step_2 was finished: only the kept checkpoint is left.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{N}"]
    assert_resumed_run_matches(uninterrupted, out, 4, N, EXACT_KEYS, tmp_path)


def test_resume_from_an_older_step_forks_and_keeps_the_old_trajectory_aside(
    tiny_model_dir, tmp_path
):
    full = tmp_path / "full"
    run_script("sft.py", *args(tiny_model_dir, full, "--ckpt.interval", "2"))

    # The same directory resumed at step 2: newer checkpoints and an unfinished save are there.
    forked = tmp_path / "forked"
    shutil.copytree(full, forked)
    (forked / "checkpoints" / "step_5.partial").mkdir()
    proc = run_script(
        "sft.py",
        *args(tiny_model_dir, forked, "--ckpt.interval", "2", "--ckpt.keep-last", "2"),
        "--resume",
        "2",
    )
    stale = ["step_4", "step_5.partial", "step_6"]
    (fork,) = (forked / "checkpoints" / ABANDONED_DIR).iterdir()
    assert sorted(p.name for p in fork.iterdir()) == stale
    for name in stale:
        assert proc.stdout.count(f"checkpoints/{name} to ") == 1, proc.stdout
    # keep_last counted only the new trajectory: its own step_4 and step_6 are kept.
    assert sorted(p.name for p in (forked / "checkpoints").iterdir()) == [
        ABANDONED_DIR,
        "step_4",
        "step_6",
    ]
    assert resolve_resume_step("latest", forked / "checkpoints") == N
    assert_resumed_run_matches(full, forked, 2, N, EXACT_KEYS, tmp_path)


def test_a_save_is_timed_in_the_next_row(uninterrupted):
    """Row N is written before step N's save, so that save's time goes into row N + 1."""
    saves = {r["step"]: r["time/save_ckpt"] for r in read_metrics(uninterrupted)}
    assert [step for step, seconds in saves.items() if seconds > 0] == [3, 5]
