"""`fnt inspect`: the summary of a run being written, a crashed run, a config diff, not-a-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fnt.__main__ import main
from fnt.apps import inspect as inspect_app
from fnt.apps.inspect import (
    ABSENT,
    config_diff,
    flock_listed,
    format_summary,
    parse_metrics,
    read_run,
    summary,
)
from fnt.errors import DataError
from fnt.store.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    WANDB_ID_FILE,
    lock_output_dir_,
)

REPO = Path(__file__).resolve().parents[2]


def config(output_dir: str, lr: float) -> dict:
    return {
        "output_dir": output_dir,
        "max_steps": 10,
        "model": {"name": "runs/tiny-model", "dtype": "float32"},
        "optim": {"lr": lr, "betas": [0.9, 0.999]},
    }


def row(step: int, **extra) -> dict:
    return {
        "step": step,
        "time": 1000.0 + 2.0 * step,
        "time/step": 2.0,
        "loss/mean": 5.0 - 0.1 * step,
        "optim/lr": 1e-3,
        "optim/grad_norm": 1.0,
        "perf/throughput": 500.0,
        "progress/num_tokens": 512.0 * step,
        "progress/num_samples": 8.0 * step,
        **extra,
    }


def write_run(path: Path, cfg: dict, rows: list[dict], tail: str = "") -> Path:
    """A run directory as the trainer leaves it; `tail` is an unfinished last line."""
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    (path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def checkpoint(run: Path, name: str, complete: bool) -> None:
    path = run / CHECKPOINTS_DIR / name
    path.mkdir(parents=True)
    (path / "progress.json").write_text("{}")
    if complete:
        (path / "COMPLETE").write_text(f"{name}\n")


@pytest.fixture
def crashed_run(tmp_path) -> Path:
    """Rows 1..7 (the last with a null grad norm), a torn line for step 8, complete checkpoints
    at steps 2 and 4, a save of step 6 cut short, a step_5 whose marker is gone, and W&B on."""
    rows = [row(step) for step in range(1, 7)] + [row(7, **{"optim/grad_norm": None})]
    run = write_run(tmp_path / "run_a", config("runs/a", 1e-3), rows, tail='{"step": 8, "lo')
    for name, complete in [("step_2", True), ("step_4", True), ("step_5", False)]:
        checkpoint(run, name, complete)
    checkpoint(run, "step_6.partial", complete=False)
    (run / WANDB_ID_FILE).write_text("abc123def456\n")
    return run


def test_inspect_json_of_a_crashed_run_with_a_diff(crashed_run, tmp_path, capsys):
    other = write_run(tmp_path / "run_b", config("runs/b", 3e-4), [row(1)])

    main(["inspect", str(crashed_run), "--json", "--diff", str(other)])

    s = json.loads(capsys.readouterr().out)
    assert s["run"] == "run_a"
    assert s["path"] == str(crashed_run)
    assert s["model"] == "runs/tiny-model"
    assert s["step"] == 7
    assert s["max_steps"] == 10
    assert s["metrics"] == {
        "loss/mean": pytest.approx(4.3),
        "optim/lr": 1e-3,
        "optim/grad_norm": None,
        "perf/throughput": 500.0,
    }
    assert s["num_tokens"] == 7 * 512 and isinstance(s["num_tokens"], int)
    assert s["num_samples"] == 7 * 8
    assert s["wall_time_s"] == pytest.approx(2.0 * 6 + 2.0)  # rows 1..7, plus step 1 itself
    assert s["checkpoints"] == [2, 4]
    assert s["partial"] == ["step_6.partial"]
    assert s["stray"] == ["step_5"]
    assert s["rows_beyond_checkpoint"] == {"first": 5, "last": 7, "checkpoint": 4}
    assert s["wandb_run_id"] == "abc123def456"
    assert len(s["notes"]) == 1 and "last line of metrics.jsonl is incomplete" in s["notes"][0]
    assert s["config_diff"] == {
        "other": str(other),
        "keys": {"optim.lr": [1e-3, 3e-4], "output_dir": ["runs/a", "runs/b"]},
    }


def test_inspect_text_names_the_rows_a_resume_would_redo(crashed_run, capsys):
    main(["inspect", str(crashed_run)])

    text = capsys.readouterr().out
    assert "steps        7 / 10" in text
    assert "rows 5..7 are beyond the newest checkpoint step_4" in text
    assert "step_6.partial (incomplete" in text
    assert "step_5 (not checkpoints" in text
    assert "optim/grad_norm null" in text
    assert "abc123def456" in text


def test_a_finished_run_has_nothing_beyond_its_checkpoint(tmp_path):
    run = write_run(tmp_path / "done", config("done", 1e-3), [row(1), row(2)])
    checkpoint(run, "step_2", complete=True)

    s = summary(read_run(run))

    assert s["rows_beyond_checkpoint"] is None
    assert s["notes"] == [] and s["partial"] == [] and s["stray"] == []
    assert "beyond" not in format_summary(s)


def test_rows_of_a_run_without_checkpoints_are_all_beyond(tmp_path):
    run = write_run(tmp_path / "fresh", config("fresh", 1e-3), [row(1), row(2), row(3)])

    s = summary(read_run(run))

    assert s["rows_beyond_checkpoint"] == {"first": 1, "last": 3, "checkpoint": None}
    assert "rows 1..3 are beyond any checkpoint" in format_summary(s)


def test_a_run_with_metrics_only_and_one_with_config_only(tmp_path):
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / METRICS_FILE).write_text(json.dumps(row(1)) + "\n")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / CONFIG_FILE).write_text(json.dumps(config("c", 1e-3)))

    a, b = summary(read_run(metrics_only)), summary(read_run(config_only))

    assert (a["step"], a["model"], a["notes"]) == (1, None, ["no config.json"])
    assert (b["step"], b["max_steps"], b["notes"]) == (None, 10, ["no metrics.jsonl"])
    assert b["wall_time_s"] is None and b["metrics"] == {}


def test_a_bad_json_last_line_is_left_out_and_a_bad_middle_line_is_an_error():
    good = json.dumps(row(1)) + "\n"

    assert parse_metrics(good + "{not json\n", "m") == ([row(1)], True)
    assert parse_metrics(good + "\n\n", "m") == ([row(1)], False)
    with pytest.raises(DataError, match=r"^m:2: not a metrics row"):
        parse_metrics(good + "{not json\n" + good, "m")
    with pytest.raises(DataError, match=r"^m:1: not a metrics row"):
        parse_metrics('{"step": "1"}\n' + good, "m")


rows_strategy = st.lists(
    st.fixed_dictionaries(
        {"step": st.integers(0, 10**6), "loss/mean": st.none() | st.floats(allow_nan=False)}
    ),
    max_size=6,
)


@given(rows=rows_strategy, data=st.data())
def test_a_run_read_while_being_written_shows_exactly_its_complete_lines(rows, data):
    lines = [json.dumps(r) + "\n" for r in rows]
    text = "".join(lines)
    cut = data.draw(st.integers(0, len(text)))

    parsed, partial = parse_metrics(text[:cut], "m")

    ends = [len("".join(lines[: i + 1])) for i in range(len(lines))]
    assert parsed == [r for r, end in zip(rows, ends) if end <= cut]
    assert partial == (cut not in [0, *ends])


def test_config_diff_marks_a_key_one_side_lacks():
    a = {"optim": {"lr": 1e-3, "betas": [0.9, 0.999]}, "seed": 0}
    b = {"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "loss": {"kind": "grpo"}}

    assert config_diff(a, b) == {
        "loss.kind": [ABSENT, "grpo"],
        "optim.betas": [[0.9, 0.999], [0.9, 0.95]],
        "seed": [0, ABSENT],
    }
    assert config_diff(a, a) == {}


def test_not_a_run_exits_2_with_a_one_line_message(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run")

    done = subprocess.run(
        [sys.executable, "-m", "fnt", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"error: {tmp_path}: not a run directory (no config.json and no metrics.jsonl)\n"
    )


def test_inspect_plot_and_the_run_directory_rules_load_without_torch():
    # fnt.store.rundir holds the names every writer and reader uses; it must stay light for them.
    probe = (
        "import sys, fnt.store.rundir, fnt.apps.inspect, fnt.apps.plot;"
        " print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.stdout.strip() == "False", done.stderr


def test_inspect_shows_a_multi_turn_runs_episodes_and_named_rewards(tmp_path, capsys):
    episodes = {
        "reward/mean": 0.5,
        "rollout/episodes": 8.0,
        "rollout/turns/mean": 2.25,
        "rollout/tool_calls/mean": 1.5,
        "rollout/tool_errors/mean": 0.25,
        "rollout/truncated_episodes": 1.0,
        "rollout/max_turns_episodes": 2.0,
        "reward/final/mean": 0.5,
        "reward/first/mean": 0.25,
        "reward/std": 0.1,  # not a named reward
    }
    run = write_run(tmp_path / "rl", config("runs/rl", 1e-3), [row(1, **episodes)])

    main(["inspect", str(run), "--json"])
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert list(metrics)[4:] == [
        "reward/mean",
        "rollout/episodes",
        "rollout/turns/mean",
        "rollout/tool_calls/mean",
        "rollout/tool_errors/mean",
        "rollout/truncated_episodes",
        "rollout/max_turns_episodes",
        "reward/final/mean",
        "reward/first/mean",
    ]
    assert metrics["rollout/turns/mean"] == 2.25 and metrics["reward/first/mean"] == 0.25

    main(["inspect", str(run)])
    text = capsys.readouterr().out
    assert "rollout/tool_errors/mean" in text and "reward/final/mean" in text


# ---------------------------------------------------------------------------------------------
# Whether a run is running, finished, stopped or crashed, and where (issue 45, item 10)


def laid_out(tmp_path: Path, last: int, complete=(), partial=(), **config_extra) -> Path:
    """A run of 10 planned steps whose rows end at `last`, with these checkpoints."""
    cfg = {**config("r", 1e-3), **config_extra}
    run = write_run(tmp_path / "r", cfg, [row(step) for step in range(1, last + 1)])
    for step in complete:
        checkpoint(run, f"step_{step}", complete=True)
    for step in partial:
        checkpoint(run, f"step_{step}.partial", complete=False)
    (run / LOCK_FILE).write_text(f"host {socket.gethostname()} pid 999999999\n")  # its holder died
    return run


@pytest.mark.parametrize(
    ("last", "complete", "partial", "extra", "state", "text"),
    [
        (10, (5, 10), (), {}, "finished", "finished: all 10 steps"),
        (10, (5,), (), {"ckpt": {"save_final": False}}, "finished", "finished: all 10 steps"),
        (7, (5,), (), {}, "crashed", "crashed in step 8 of 10: the last row is step 7"),
        (7, (), (), {}, "crashed", "crashed in step 8 of 10: the last row is step 7"),
        (6, (4,), (6,), {}, "crashed", "crashed while saving the checkpoint after step 6"),
        (10, (5,), (10,), {}, "crashed", "crashed while saving the final checkpoint step_10"),
        (0, (), (), {}, "crashed", "crashed before its first step ended (no row"),
        (
            6,
            (3, 6),
            (),
            {},
            "stopped",
            "stopped after step 6 of 10, its checkpoint step_6 complete",
        ),
    ],
)
def test_the_state_of_a_run_that_is_not_running(
    tmp_path, last, complete, partial, extra, state, text
):
    s = summary(read_run(laid_out(tmp_path, last, complete, partial, **extra)))
    assert s["state"] == state and s["state_text"].startswith(text), s["state_text"]
    if state != "finished":
        assert (
            s["state_text"].endswith("no process holds run.lock") or "run.lock)" in s["state_text"]
        )
    assert f"state        {text}" in format_summary(s)


def test_a_torn_last_row_is_a_crash_even_at_a_checkpoint(tmp_path):
    run = laid_out(tmp_path, 6, complete=(6,))
    with open(run / METRICS_FILE, "a") as fh:
        fh.write('{"step": 7, "lo')
    assert summary(read_run(run))["state_text"].startswith("crashed in step 7 of 10")


def test_a_run_holding_its_lock_is_running_and_released_it_is_not(tmp_path):
    run = laid_out(tmp_path, 3)
    lock = lock_output_dir_(run)  # what a run takes first, and holds until its process ends
    try:
        s = summary(read_run(run))
        assert s["state"] == "running"
        assert (
            s["state_text"]
            == f"running: a process holds run.lock (host {socket.gethostname()} pid {os.getpid()})"
        )
    finally:
        lock.close()
    assert summary(read_run(run))["state_text"].startswith("crashed in step 4 of 10")


def test_a_lock_named_by_another_machine_is_unknown_and_no_config_is_unknown(tmp_path):
    run = laid_out(tmp_path, 3)
    (run / LOCK_FILE).write_text("host some-other-node pid 12\n")
    s = summary(read_run(run))
    assert (
        s["state"] == "unknown"
        and "names another machine (host some-other-node pid 12)" in s["state_text"]
    )
    (run / CONFIG_FILE).unlink()
    assert summary(read_run(run))["state_text"] == "unknown: no config.json says how many steps"


def test_without_proc_locks_the_holders_pid_on_this_host_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(inspect_app, "PROC_LOCKS", str(tmp_path / "no_proc_locks"))
    run = laid_out(tmp_path, 3)
    assert summary(read_run(run))["state"] == "crashed"  # pid 999999999 does not exist
    (run / LOCK_FILE).write_text(f"host {socket.gethostname()} pid {os.getpid()}\n")
    assert summary(read_run(run))["state"] == "running"
    (run / LOCK_FILE).write_text("host some-other-node pid 12\n")
    assert summary(read_run(run))["state"] == "unknown"


def test_proc_locks_lines_are_matched_by_device_and_inode_and_waiters_do_not_count():
    text = (
        "1: FLOCK  ADVISORY  WRITE 27782 fe:00:2302177 0 EOF\n"
        "2: POSIX  ADVISORY  WRITE 24210 fe:00:5 0 EOF\n"
        "3: FLOCK  ADVISORY  WRITE 24210 08:01:7 0 EOF\n"
        "3: -> FLOCK  ADVISORY  WRITE 24341 08:01:9 0 EOF\n"
    )
    assert flock_listed(text, 0xFE, 0, 2302177) and flock_listed(text, 8, 1, 7)
    assert not flock_listed(text, 0xFE, 0, 5)  # a POSIX lock is not the run's flock
    assert not flock_listed(text, 8, 1, 9)  # a process waiting for a lock does not hold it
    assert not flock_listed(text, 0xFE, 1, 2302177)


def test_inspect_json_has_the_state(crashed_run, capsys):
    main(["inspect", str(crashed_run), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert s["state"] == "crashed" and s["state_text"].startswith("crashed in step 8 of 10")
