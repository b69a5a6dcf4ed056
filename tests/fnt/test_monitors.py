"""Monitors: strict JSON lines, the repair of metrics.jsonl on resume, the console line (W&B:
test_wandb.py)."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.config import Config, ConfigError, validate
from fnt.obs.monitors import MONITORS, MonitorEntry, open_monitors
from fnt.obs.monitors.console import console_line
from fnt.obs.monitors.jsonl import JsonlMonitor, repair_metrics_, repair_rows, strict_json_line
from fnt.store.rundir import METRICS_FILE, METRICS_MISSING_FILE, read_missing_steps, step_ranges
from fnt.testing.strategies import metrics_files
from tests.e2e.helpers import read_metrics
from tests.fnt.recording_monitor import recorded

SETTINGS = settings(max_examples=150, deadline=None)
TMP_BASE = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _strict_loads(line: str):
    def reject(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


row_values = st.one_of(
    st.floats(), st.integers(-(2**53), 2**53), st.text(max_size=10), st.none(), st.booleans()
)
rows = st.dictionaries(st.text(min_size=1, max_size=12), row_values, max_size=12)


@SETTINGS
@given(rows)
def test_strict_json_line(row):
    line = strict_json_line(row)
    assert "\n" not in line and "\r" not in line
    back = _strict_loads(line)
    assert set(back) == set(row)
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            assert back[key] is None
        else:
            assert back[key] == value and type(back[key]) is type(value)


def test_strict_json_line_example():
    line = strict_json_line(
        {"step": 3, "loss/mean": float("nan"), "perf/mfu": float("inf"), "x": 0.5}
    )
    assert line == '{"step": 3, "loss/mean": null, "perf/mfu": null, "x": 0.5}'


@SETTINGS
@given(metrics_files(), st.integers(0, 45))
def test_repair_keeps_the_last_row_of_each_step_and_names_every_dropped_line(file, last_step):
    lines, good = file
    repair = repair_rows(lines, last_step)
    last_line_of = {step: n for n, step in enumerate(good, 1) if step is not None}
    expected = {s: n for s, n in sorted(last_line_of.items()) if s <= last_step}
    assert list(repair.kept) == list(expected)
    for step, number in expected.items():
        assert repair.kept[step] == lines[number - 1].rstrip("\n") + "\n"
    assert repair.missing == [s for s in range(1, last_step + 1) if s not in expected]
    assert repair.beyond == sorted({s for s in good if s is not None and s > last_step})
    assert set(repair.unreadable) == {
        n for n, step in enumerate(good, 1) if step is None and lines[n - 1].strip()
    }
    # Every line of the file is kept, or named by a message (unreadable, duplicated, beyond).
    named = set(repair.unreadable)
    named |= {n for numbers in repair.duplicated.values() for n in numbers[:-1]}
    named |= {n for n, step in enumerate(good, 1) if step in repair.beyond}
    kept = {expected[s] for s in expected}
    assert {n for n, line in enumerate(lines, 1) if line.strip()} == named | kept
    messages = repair.messages("m.jsonl", "missing.json", known_missing=())
    assert len(messages) == (
        len(repair.unreadable) + len(repair.duplicated) + bool(repair.beyond) + bool(repair.missing)
    )


@SETTINGS
@given(metrics_files(), st.integers(0, 45))
def test_repair_on_disk_writes_the_kept_rows_and_records_the_missing_steps(file, last_step):
    lines, _ = file
    with tempfile.TemporaryDirectory(dir=TMP_BASE) as tmp:
        path = Path(tmp) / METRICS_FILE
        path.write_text("".join(lines))
        repair_metrics_(path, last_step)
        repair = repair_rows(lines, last_step)
        assert path.read_text() == "".join(repair.kept.values())
        assert read_missing_steps(Path(tmp) / METRICS_MISSING_FILE) == (repair.missing, None)
        assert repair_metrics_(path, last_step) == []  # repaired: nothing more to say
        expected = {METRICS_FILE} | ({METRICS_MISSING_FILE} if repair.missing else set())
        assert {p.name for p in Path(tmp).iterdir()} == expected


def test_a_damaged_row_and_a_duplicated_pair_are_reported_with_their_line_numbers(tmp_path):
    """The issue's cases: a row that lost a quote, and rows 1,2,3,4,3,4,5 resumed at step 5."""
    path = tmp_path / METRICS_FILE
    rows = [strict_json_line({"step": s, "loss/mean": 1.0}) + "\n" for s in (1, 2, 3, 4, 3, 4, 5)]
    rows[1] = rows[1].replace('"step"', 'step"', 1)
    path.write_text("".join(rows))
    messages = repair_metrics_(path, 5)
    assert messages == [
        f"{path}:2: not a metrics row (invalid JSON at column 2: Expecting property name "
        "enclosed in double quotes); dropped",
        f"{path}: step 3 has 2 rows (lines 3, 5); kept the last",
        f"{path}: step 4 has 2 rows (lines 4, 6); kept the last",
        f"{path}: steps 2 have no readable row; recorded as missing in {METRICS_MISSING_FILE}",
    ]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3, 4, 5]
    assert read_missing_steps(tmp_path / METRICS_MISSING_FILE) == ([2], None)
    # The next resume does not report step 2 again; it is still recorded.
    assert repair_metrics_(path, 5) == []
    assert read_missing_steps(tmp_path / METRICS_MISSING_FILE) == ([2], None)


@pytest.mark.parametrize(
    "garbled",
    [b"", b"\0" * 16, b'{"missing_steps": "3"}', b'{"steps": [3]}', b'{"missing_steps": [3',
     b"\xff\xfe", b'{"missing_steps": [0, true]}'],
    ids=["empty", "zeros", "a-string", "no-key", "cut", "not-utf8", "not-steps"],
)  # fmt: skip
def test_a_garbled_missing_file_is_one_line_and_rewritten_from_the_rows(tmp_path, garbled):
    path = tmp_path / METRICS_FILE
    path.write_text("".join(strict_json_line({"step": s}) + "\n" for s in (1, 3)))
    missing = tmp_path / METRICS_MISSING_FILE
    missing.write_bytes(garbled)
    messages = repair_metrics_(path, 3)
    assert messages[0].startswith(f"{missing}: unreadable (") and messages[0].endswith("; ignored")
    assert messages[1:] == [
        f"{path}: steps 2 have no readable row; recorded as missing in {METRICS_MISSING_FILE}"
    ]
    assert read_missing_steps(missing) == ([2], None)


def test_rows_beyond_the_start_are_dropped_with_one_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text("".join(strict_json_line({"step": s}) + "\n" for s in range(1, 9)))
    assert repair_metrics_(path, 5) == [
        f"{path}: dropped the rows of steps 6..8, after the step this run starts from "
        "(it redoes them)"
    ]


def test_step_ranges():
    assert step_ranges([]) == ""
    assert step_ranges([3]) == "3"
    assert step_ranges([8, 1, 2, 3, 5, 7]) == "1..3, 5, 7..8"


def test_repairing_a_missing_file_is_a_no_op(tmp_path):
    assert repair_metrics_(tmp_path / METRICS_FILE, 0) == []
    assert list(tmp_path.iterdir()) == []


def test_jsonl_monitor_resume_keeps_one_row_per_step(tmp_path):
    path = tmp_path / "run" / METRICS_FILE
    config = Config(output_dir=str(tmp_path / "run"))
    first = JsonlMonitor(config, start_step=0)
    for step in range(1, 6):
        first.log({"step": step, "time": float(step), "loss/mean": 1.0 / step})
    first.close()
    with open(path, "a") as fh:
        fh.write('{"step": 6, "loss/m')  # a crash mid-write
    # Resume from checkpoint step_3: rows 4, 5 and the torn 6 are redone.
    second = JsonlMonitor(config, start_step=3)
    for step in range(4, 8):
        second.log(
            {"step": step, "time": float(step), "loss/mean": float("nan") if step == 7 else 0.5}
        )
    second.close()
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert rows[2]["loss/mean"] == 1.0 / 3 and rows[3]["loss/mean"] == 0.5
    assert rows[-1]["loss/mean"] is None
    for line in path.read_text().splitlines():
        _strict_loads(line)


def test_open_monitors_without_wandb_writes_jsonl_and_console(tmp_path, capsys):
    config = Config(output_dir=str(tmp_path / "run"), max_steps=2)
    monitors = open_monitors(config, start_step=0)
    monitors.log({"step": 1, "time": 0.0, "loss/mean": 2.0, "optim/lr": 1e-3})
    monitors.log({"step": 2, "time": 0.5, "loss/mean": 1.5, "optim/lr": 1e-3})
    monitors.close()
    assert [r["step"] for r in read_metrics(config.output_dir)] == [1, 2]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("step 1/2") and "loss 2.0000" in out[0]
    assert not (tmp_path / "run" / "wandb").exists()


# ---------------------------------------------------------------------------------------------
# console_line


def test_console_line_fields():
    row = {
        "step": 3,
        "loss/mean": 2.125,
        "optim/lr": 1e-3,
        "perf/throughput": 512.4,
        "time/step": 0.25,
    }
    line = console_line(row, max_steps=5, elapsed=0.5, steps_done=2)
    parts = line.split(" | ")
    assert parts[0] == "step 3/5"
    assert "loss 2.1250" in parts and "lr 1.00e-03" in parts and "512 tok/s" in parts
    assert "0.25 s/step" in parts
    assert parts[-1] == "eta 00:00:00" or parts[-1] == "eta 0:00:00"


def test_console_line_shows_reward_grad_norm_and_validation_when_the_row_has_them():
    row = {
        "step": 4,
        "loss/mean": -3e-7,
        "reward/mean": 0.5123,
        "optim/grad_norm": 0.8312,
        "optim/lr": 1e-3,
        "val/loss": 2.3,
        "val/reward/mean": 0.25,
    }
    parts = console_line(row, max_steps=8, elapsed=1.0, steps_done=4).split(" | ")
    assert parts[:7] == [
        "step 4/8",
        "loss -3.00e-07",  # not -0.0000
        "reward 0.512",
        "grad 0.831",
        "lr 1.00e-03",
        "val/loss 2.3000",
        "val/reward 0.250",
    ]


def test_a_console_line_shows_the_sampled_held_out_rewards_of_val_samples():
    row = {
        "step": 4,
        "val/reward/mean": 0.25,
        "val/reward/avg@4": 0.3125,
        "val/reward/pass@4": 0.5,
        "val/start/reward/pass@4": 0.25,
    }
    parts = console_line(row, max_steps=8, elapsed=1.0, steps_done=4).split(" | ")
    assert parts[1:5] == [
        "val/reward 0.250",
        "val/avg@4 0.312",
        "val/pass@4 50%",
        "val/start/pass@4 25%",
    ]


def test_an_rl_console_line_shows_the_mean_turns_of_the_episodes():
    row = {"step": 2, "loss/mean": 0.1, "reward/mean": 0.5, "rollout/turns/mean": 2.25}
    parts = console_line(row, max_steps=4, elapsed=1.0, steps_done=2).split(" | ")
    assert parts[:4] == ["step 2/4", "loss 0.1000", "reward 0.500", "turns 2.25"]


def test_console_line_non_finite_loss_and_missing_fields():
    line = console_line(
        {"step": 1, "loss/mean": float("nan")}, max_steps=2, elapsed=0.0, steps_done=0
    )
    assert line.startswith("step 1/2 | loss nan")
    assert "lr" not in line and "tok/s" not in line


def _eta_seconds(line: str) -> int:
    text = line.rsplit("eta ", 1)[1]
    match = re.fullmatch(r"(?:(\d+) days?, )?(\d+):(\d\d):(\d\d)", text)
    assert match, text
    days, h, m, s = (int(g) if g else 0 for g in match.groups())
    return ((days * 24 + h) * 60 + m) * 60 + s


@pytest.mark.parametrize(
    "elapsed, steps_done, step, max_steps",
    [(10.0, 2, 2, 5), (3600.0, 1, 1, 3), (1000.0, 1, 1, 101), (7200.0, 2, 2, 100)],
)
def test_console_line_eta(elapsed, steps_done, step, max_steps):
    """ETA = elapsed per step x remaining steps, also when that is more than a day."""
    line = console_line({"step": step}, max_steps, elapsed, steps_done)
    expected = elapsed / steps_done * (max_steps - step)
    assert _eta_seconds(line) == int(expected)


# ---------------------------------------------------------------------------------------------
# W&B: run id bookkeeping and offline runs


RECORDER = "tests.fnt.recording_monitor:RecordingMonitor"


def test_a_monitor_named_in_config_gets_every_row_and_reads_back_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    config = Config(output_dir=str(out), max_steps=4, monitors=(RECORDER,))
    first = open_monitors(config, start_step=0)
    for step in (1, 2, 3):
        first.log({"step": step, "time": float(step)})
    first.close()
    # Resumed from step_2: metrics.jsonl is trimmed to rows 1..2 before the hook reads it back.
    second = open_monitors(config, start_step=2)
    second.log({"step": 3, "time": 3.5})
    second.close()
    assert recorded(out) == [
        {"event": "open", "start_step": 0},
        {"event": "log", "step": 1},
        {"event": "log", "step": 2},
        {"event": "log", "step": 3},
        {"event": "close"},
        {"event": "open", "start_step": 2},
        {"event": "resume", "start_step": 2, "read_back": [1, 2]},
        {"event": "log", "step": 3},
        {"event": "close"},
    ]
    assert [row["step"] for row in read_metrics(str(out))] == [1, 2, 3]


def test_a_built_in_monitor_is_its_file_and_one_table_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(MONITORS, "recorder", MonitorEntry(RECORDER))
    out = tmp_path / "run"
    monitors = open_monitors(Config(output_dir=str(out)), start_step=0)
    monitors.log({"step": 1, "time": 1.0})
    monitors.close()
    assert [r["event"] for r in recorded(out)] == ["open", "log", "close"]
    assert list(MONITORS)[0] == "jsonl"  # metrics.jsonl has a row before any monitor sees it


def test_a_monitor_that_cannot_start_closes_those_before_it(tmp_path):
    out = tmp_path / "run"
    broken = "tests.fnt.recording_monitor:BrokenMonitor"
    config = Config(output_dir=str(out), monitors=(RECORDER, broken))
    with pytest.raises(RuntimeError, match="cannot start"):
        open_monitors(config, start_step=0)
    assert [r["event"] for r in recorded(out)] == ["open", "close"]


@pytest.mark.parametrize(
    "name, problem",
    [
        ("tests.fnt.recording_monitor", "not of the form 'module:function'"),
        ("tests.fnt.nowhere:Monitor", "cannot import module"),
        ("tests.fnt.recording_monitor:Missing", "has no attribute 'Missing'"),
        ("tests.fnt.recording_monitor:recorded", "cannot take 2 positional arguments"),
    ],
)
def test_a_bad_monitor_reference_is_one_config_error(name, problem):
    with pytest.raises(
        ConfigError, match=rf"^'monitors\[0\]' = '{name}': .*{problem}.*Class\(config"
    ):
        validate(Config(monitors=(name,)), 1)


def test_a_dpo_console_line_shows_reward_accuracy_and_margin_after_the_loss():
    row = {
        "step": 3,
        "loss/mean": 0.62,
        "rewards/accuracies": 0.75,
        "rewards/margins": 0.4123,
        "optim/lr": 1e-3,
        "val/loss": 0.6,
        "val/rewards/accuracies": 0.5,
    }
    parts = console_line(row, max_steps=5, elapsed=1.0, steps_done=3).split(" | ")
    assert parts[:4] == ["step 3/5", "loss 0.6200", "acc 75%", "margin 0.412"]
    assert "val/acc 50%" in parts
