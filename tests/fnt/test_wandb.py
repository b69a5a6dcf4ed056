"""W&B: rows equal metrics.jsonl after a resume (rewind, else fork, else a linked new run), and a
W&B that fails, hangs or falls behind never holds up training. A fake `wandb` module with the
server's history semantics stands in for the service; one test uses the real one offline."""

from __future__ import annotations

import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest

from fnt.config import Config, WandbConfig
from fnt.obs.monitors import open_monitors
from fnt.obs.monitors.wandb import (
    WANDB_QUEUE_ROWS,
    WandbMonitor,
    recorded_wandb_run_id,
    replay_steps,
    wandb_init_attempts,
)
from fnt.store.rundir import WANDB_ID_FILE
from tests.e2e.helpers import read_metrics


def test_a_fresh_run_starts_a_new_wandb_run():
    assert wandb_init_attempts(None, 0, "new") == [{"id": "new"}]
    assert wandb_init_attempts("old", 0, "new") == [{"id": "new"}]
    assert wandb_init_attempts(None, 7, "new") == [{"id": "new"}]  # nothing recorded to continue


def test_a_resume_rewinds_else_forks_else_links_a_new_run():
    assert wandb_init_attempts("old", 4, "new") == [
        {"resume_from": "old?_step=4"},
        {"id": "new", "fork_from": "old?_step=4"},
        {"id": "new", "resumed_from": "old?_step=4"},
    ]


class FakeWandb(types.ModuleType):
    """`wandb` as the server sees it: each run's history is {step: values}; a rewind to step N
    drops the history after N, a fork copies it up to N. `refuse` names the init kinds the
    "server" rejects; `block` makes log (or finish) wait until it is set."""

    def __init__(self, refuse=(), block_log=None, block_finish=None):
        super().__init__("wandb")
        self.stall_after: int | None = None  # logs after this many hang for good (a dead run)
        self.log_seconds = 0.0  # how long each log takes
        self.logs = 0
        self.histories: dict[str, dict[int, dict]] = {}
        self.configs: dict[str, dict] = {}
        self.inits: list[dict] = []
        self.refuse = set(refuse)
        self.block_log = block_log
        self.block_finish = block_finish

    def init(self, **kwargs):
        self.inits.append(kwargs)
        if "resume_from" in kwargs:
            if "rewind" in self.refuse:
                raise RuntimeError("rewind is not enabled for this entity")
            run_id, step = _split(kwargs["resume_from"])
            history = self.histories[run_id]
            for later in [s for s in history if s > step]:
                del history[later]
        elif "fork_from" in kwargs:
            if "fork" in self.refuse:
                raise RuntimeError("fork is not enabled for this entity")
            source, step = _split(kwargs["fork_from"])
            run_id = kwargs["id"]
            self.histories[run_id] = {s: v for s, v in self.histories[source].items() if s <= step}
        else:
            run_id = kwargs["id"]
            self.histories[run_id] = {}
        self.configs[run_id] = kwargs["config"]
        return FakeRun(self, run_id)


def _split(point: str) -> tuple[str, int]:
    run_id, step = point.split("?_step=")
    return run_id, int(step)


class FakeRun:
    def __init__(self, wandb: FakeWandb, run_id: str) -> None:
        self.wandb, self.id = wandb, run_id

    def log(self, values, step):
        if self.wandb.block_log is not None:
            self.wandb.block_log.wait()
        time.sleep(self.wandb.log_seconds)
        self.wandb.logs += 1
        if self.wandb.stall_after is not None and self.wandb.logs > self.wandb.stall_after:
            threading.Event().wait()  # the process died inside this call: nothing more arrives
        history = self.wandb.histories[self.id]
        if history and step <= max(history):
            return  # what W&B does with a step it has already passed: drops it
        history[step] = values

    def finish(self):
        if self.wandb.block_finish is not None:
            self.wandb.block_finish.wait()


@pytest.fixture
def fake_wandb(monkeypatch):
    def install(**kwargs) -> FakeWandb:
        fake = FakeWandb(**kwargs)
        monkeypatch.setitem(sys.modules, "wandb", fake)
        return fake

    return install


def _config(out: Path, timeout_s: float = 60.0) -> Config:
    return Config(output_dir=str(out), wandb=WandbConfig(mode="offline", timeout_s=timeout_s))


def _rows(first: int, last: int, tag: str) -> list[dict]:
    return [
        {"step": s, "time": 0.0, "loss/mean": float(s), "tag": tag} for s in range(first, last + 1)
    ]


def _log_all(monitors, rows) -> None:
    for row in rows:
        monitors.log(row)


def _wandb_rows(fake: FakeWandb, run_id: str) -> list[dict]:
    return [{"step": s, **v} for s, v in sorted(fake.histories[run_id].items())]


def _crash_then_resume(out: Path, start_step: int) -> None:
    """Steps 1..5 logged, then a crash (no close); the resumed run logs start_step+1..6."""
    crashed = open_monitors(_config(out), start_step=0)
    _log_all(crashed, _rows(1, 5, "crashed"))
    crashed.monitors[1].close()  # let the fake "server" see every row the crashed run sent
    crashed.monitors[0].close()
    resumed = open_monitors(_config(out), start_step=start_step)
    _log_all(resumed, _rows(start_step + 1, 6, "resumed"))
    resumed.close()


@pytest.mark.parametrize(
    "refuse", [(), ("rewind",), ("rewind", "fork")], ids=["rewind", "fork", "new"]
)
def test_after_a_crash_and_resume_the_wandb_run_holds_the_rows_of_metrics_jsonl(
    tmp_path, fake_wandb, refuse
):
    fake = fake_wandb(refuse=refuse)
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no W&B warning on any of the three ways
        _crash_then_resume(out, start_step=3)
    first_id = fake.inits[0]["id"]
    run_id = recorded_wandb_run_id(out)
    jsonl = read_metrics(str(out))
    assert [r["tag"] for r in jsonl] == ["crashed"] * 3 + ["resumed"] * 3
    if refuse == ():
        assert run_id == first_id
        assert _wandb_rows(fake, run_id) == jsonl
    elif refuse == ("rewind",):
        assert run_id != first_id and fake.inits[-1]["fork_from"] == f"{first_id}?_step=3"
        assert _wandb_rows(fake, run_id) == jsonl
    else:  # a new run, whose config says where it came from, sent every row
        assert run_id != first_id
        assert fake.configs[run_id]["fnt_resumed_from"] == f"{first_id}?_step=3"
        assert _wandb_rows(fake, run_id) == jsonl


@pytest.mark.parametrize(
    "refuse", [(), ("rewind",), ("rewind", "fork")], ids=["rewind", "fork", "new"]
)
@pytest.mark.parametrize("taken", [0, 2, 7])
def test_rows_wandb_never_took_before_a_crash_are_sent_again_in_step_order(
    tmp_path, fake_wandb, refuse, taken
):
    """The issue's case: W&B behind when the run died after checkpointing step 8 (rows 1..8 on
    disk, `taken` of them sent); the resume at 8 must leave W&B with rows 1..12."""
    fake = fake_wandb(refuse=refuse)
    fake.stall_after = taken
    out = tmp_path / "run"
    crashed = open_monitors(_config(out), start_step=0)
    _log_all(crashed, _rows(1, 8, "crashed"))
    deadline = time.monotonic() + 10
    while fake.logs <= taken and time.monotonic() < deadline:  # W&B got its `taken` rows
        time.sleep(0.01)
    crashed.monitors[0].close()  # the process dies: W&B's thread never goes on
    fake.stall_after = None
    old_id = recorded_wandb_run_id(out)
    assert sorted(fake.histories[old_id]) == list(range(1, taken + 1))
    resumed = open_monitors(_config(out), start_step=8)
    _log_all(resumed, _rows(9, 12, "resumed"))
    resumed.close()
    assert _wandb_rows(fake, recorded_wandb_run_id(out)) == read_metrics(str(out))
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 13))


@pytest.mark.parametrize(
    "garbled",
    [b"", b"\0" * 16, b'{"run_id": "x"}', b'{"run_id": "x", "step": 3', b"\xff\xfe", b"[3]"],
    ids=["empty", "zeros", "no-step", "cut", "not-utf8", "a-list"],
)
def test_a_garbled_wandb_logged_is_one_line_and_every_row_is_sent_again(
    tmp_path, fake_wandb, capsys, garbled
):
    fake = fake_wandb()
    out = tmp_path / "run"
    crashed = open_monitors(_config(out), start_step=0)
    _log_all(crashed, _rows(1, 5, "crashed"))
    crashed.monitors[1].close()
    crashed.monitors[0].close()
    (out / "wandb_logged").write_bytes(garbled)
    capsys.readouterr()
    resumed = open_monitors(_config(out), start_step=3)
    _log_all(resumed, _rows(4, 6, "resumed"))
    resumed.close()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "unreadable" in x]
    assert line.startswith(f"{out / 'wandb_logged'}: unreadable (")
    assert line.endswith(
        "); W&B is sent every row of metrics.jsonl again (it keeps the first row of a step)"
    )
    assert _wandb_rows(fake, recorded_wandb_run_id(out)) == read_metrics(str(out))


def test_replay_steps():
    logged = {"run_id": "old", "step": 5}
    assert list(replay_steps({"resume_from": "old?_step=8"}, logged, 8)) == [6, 7, 8]
    assert list(replay_steps({"resume_from": "old?_step=3"}, logged, 3)) == []
    assert list(replay_steps({"id": "n", "fork_from": "old?_step=8"}, logged, 8)) == [6, 7, 8]
    assert list(replay_steps({"id": "n", "fork_from": "old?_step=8"}, None, 8)) == list(range(1, 9))
    other = {"run_id": "another", "step": 5}  # a record of another run says nothing of this one
    assert list(replay_steps({"resume_from": "old?_step=2"}, other, 2)) == [1, 2]
    assert list(replay_steps({"id": "n", "resumed_from": "old?_step=2"}, logged, 2)) == [1, 2]
    assert list(replay_steps({"id": "n"}, logged, 0)) == []
    assert list(replay_steps({"id": "n"}, None, 2)) == [1, 2]  # W&B turned on at a resume


def test_without_rewind_a_plain_resume_of_the_same_id_would_keep_the_crashed_rows(fake_wandb):
    # What the rewind is for: W&B drops the log of any step it has already passed.
    fake = fake_wandb()
    run = fake.init(id="r", config={})
    for row in _rows(1, 5, "crashed"):
        run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    run.log({"tag": "resumed"}, step=4)
    assert fake.histories["r"][4]["tag"] == "crashed"


def _warnings_of(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught]


def _returns_promptly(action, seconds: float = 20.0) -> None:
    """Run `action` on a thread; fail (instead of hanging the suite) if it has not returned."""
    done = threading.Thread(target=action, daemon=True)
    done.start()
    done.join(seconds)
    assert not done.is_alive(), "the monitor waited for a blocked W&B call"


def test_a_hanging_log_disables_wandb_once_and_never_blocks(tmp_path, fake_wandb):
    release = threading.Event()
    fake = fake_wandb(block_log=release)
    out = tmp_path / "run"
    monitors = open_monitors(_config(out, timeout_s=0.2), start_step=0)
    wandb_monitor = monitors.monitors[1]

    def train():
        _log_all(monitors, _rows(1, 3, "a"))
        threading.Event().wait(0.5)  # the first log has now been stuck for longer than 0.2 s
        _log_all(monitors, _rows(4, 8, "a"))
        monitors.close()

    try:
        messages = _warnings_of(lambda: _returns_promptly(train))
        assert fake.histories[recorded_wandb_run_id(out)] == {}  # nothing got through
    finally:
        release.set()
    assert wandb_monitor.disabled
    assert len(messages) == 1 and "log of step 1 has not returned" in messages[0], messages
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 9))


def test_a_full_queue_disables_wandb_once(tmp_path, fake_wandb):
    release = threading.Event()
    fake_wandb(block_log=release)
    monitor = WandbMonitor(_config(tmp_path / "run", timeout_s=600), start_step=0)
    rows = _rows(1, WANDB_QUEUE_ROWS + 5, "a")
    try:
        messages = _warnings_of(lambda: _returns_promptly(lambda: _log_all(monitor, rows)))
    finally:
        release.set()
    assert monitor.disabled
    assert len(messages) == 1 and "rows behind" in messages[0], messages


def test_finish_has_a_timeout_of_its_own(tmp_path, fake_wandb):
    release = threading.Event()
    fake = fake_wandb(block_finish=release)
    out = tmp_path / "run"
    config = Config(
        output_dir=str(out),
        wandb=WandbConfig(mode="offline", timeout_s=60, finish_timeout_s=0.3),
    )
    monitor = WandbMonitor(config, start_step=0)
    _log_all(monitor, _rows(1, 2, "a"))
    started = time.monotonic()
    try:
        messages = _warnings_of(lambda: _returns_promptly(monitor.close))
    finally:
        release.set()
    assert time.monotonic() - started < 5  # not wandb.timeout_s
    assert len(messages) == 1 and "did not finish within wandb.finish_timeout_s" in messages[0]
    assert sorted(fake.histories[recorded_wandb_run_id(out)]) == [1, 2]


def test_rows_still_queued_at_the_end_get_wandb_timeout_s_in_all(tmp_path, fake_wandb):
    fake = fake_wandb()
    fake.log_seconds = 0.1  # each log returns well within the timeout, 30 of them do not
    monitor = WandbMonitor(_config(tmp_path / "run", timeout_s=0.5), start_step=0)
    _log_all(monitor, _rows(1, 30, "a"))
    started = time.monotonic()
    messages = _warnings_of(lambda: _returns_promptly(monitor.close))
    assert time.monotonic() - started < 1.5
    assert len(messages) == 1 and "did not take its last rows" in messages[0], messages


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """The real W&B offline, with every file it writes under tmp_path and no account."""
    for name in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_DIR",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_PROJECT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    return tmp_path


def test_real_wandb_offline_logs_then_rewinds_on_resume(wandb_env):
    out = wandb_env / "run"
    config = Config(
        output_dir=str(out), wandb=WandbConfig(mode="offline", project="fnt-test", name="t")
    )

    def both_runs():
        monitor = WandbMonitor(config, start_step=0)
        monitor.log({"step": 1, "time": 0.1, "loss/mean": 2.0, "perf/mfu": float("nan")})
        monitor.log({"step": 2, "time": 0.2, "loss/mean": 1.0})
        monitor.close()
        assert monitor.run is not None and not monitor.disabled
        run_id = monitor.run.id
        assert (out / WANDB_ID_FILE).read_text().strip() == run_id
        runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
        assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").is_file()

        resumed = WandbMonitor(config, start_step=2)
        resumed.log({"step": 3, "time": 0.3, "loss/mean": 0.5})
        resumed.close()
        assert resumed.run is not None and resumed.run.id == run_id  # a rewind keeps the id

    assert [m for m in _warnings_of(both_runs) if "W&B" in m] == []


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            lambda out: Config(output_dir=out, wandb=WandbConfig(mode="bogus")), id="bad-mode"
        ),
        pytest.param(
            lambda out: Config(output_dir=out, wandb=WandbConfig(mode="offline", project="a/b#?")),
            id="bad-project",
        ),
        pytest.param(
            lambda out: Config(output_dir=out, seed=object(), wandb=WandbConfig(mode="offline")),
            id="unserializable-config",
        ),
    ],
)
def test_wandb_init_failure_only_warns(wandb_env, config):
    cfg = config(str(wandb_env / "run"))

    def use():
        monitor = WandbMonitor(cfg, start_step=0)
        monitor.log({"step": 1, "time": 0.0, "loss/mean": 1.0})
        monitor.close()
        assert monitor.run is None and monitor.disabled

    messages = _warnings_of(use)
    assert sum("W&B init failed" in m for m in messages) == 1, messages


def test_wandb_log_failure_only_warns_and_disables(tmp_path, fake_wandb):
    fake = fake_wandb()

    def failing_log(self, values, step):
        raise RuntimeError("the service went away")

    out = tmp_path / "run"
    monitor = WandbMonitor(_config(out), start_step=0)
    FakeRun.log, original = failing_log, FakeRun.log
    try:
        messages = _warnings_of(lambda: (_log_all(monitor, _rows(1, 2, "a")), monitor.close()))
    finally:
        FakeRun.log = original
    assert monitor.disabled
    assert messages == ["W&B log failed at step 1, disabling W&B: the service went away"]
    assert fake.histories[recorded_wandb_run_id(out)] == {}


def test_wandb_failure_never_costs_the_jsonl_row(wandb_env):
    config = Config(output_dir=str(wandb_env / "run"), wandb=WandbConfig(mode="bogus"))

    def use():
        monitors = open_monitors(config, start_step=0)
        monitors.log({"step": 1, "time": 0.0, "loss/mean": 1.0})
        monitors.close()

    _warnings_of(use)
    assert read_metrics(config.output_dir) == [{"step": 1, "time": 0.0, "loss/mean": 1.0}]
