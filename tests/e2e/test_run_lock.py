"""One run per output directory: a second run on it exits 2 at once, naming the holder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fnt.errors import ConfigError
from fnt.store.rundir import LOCK_FILE, METRICS_FILE, lock_output_dir_
from tests.e2e.helpers import REPO, TORCHRUN, config_args, run_cli, run_script


def test_the_lock_is_exclusive_and_names_its_holder(tmp_path):
    held = lock_output_dir_(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        lock_output_dir_(tmp_path / "run")
    assert f"host {socket.gethostname()} pid {os.getpid()}" in str(info.value)
    # The refused attempt left the holder's text alone.
    assert (
        tmp_path / "run" / LOCK_FILE
    ).read_text() == f"host {socket.gethostname()} pid {os.getpid()}\n"
    held.close()
    lock_output_dir_(tmp_path / "run").close()


def wait_for_rows(path, rows, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the first run exited {proc.returncode}"
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {rows} rows in {timeout} s")


def test_a_second_run_on_the_same_directory_exits_2_naming_the_first(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # Far more steps than the test needs: the first run must still be training when the second
    # one starts; it is killed once the second has been refused. Its stderr goes to a file, as a
    # pipe nobody reads while it runs could fill up and stall it.
    with open(tmp_path / "first.stderr", "w") as first_stderr:
        first = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "scripts" / "sft.py"),
                *config_args(
                    "examples/debug/sft.toml", tiny_model_dir, out, "--max-steps", "100000"
                ),
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=first_stderr,
            start_new_session=True,
        )
        try:
            wait_for_rows(out / METRICS_FILE, 1, first)
            second = run_script(
                "sft.py",
                *config_args("examples/debug/sft.toml", tiny_model_dir, out, "--resume", "latest"),
                check=False,
            )
            assert first.poll() is None
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"pid {first.pid}" in line, line
    assert socket.gethostname() in line

    # The dead run's lock file is still there, but its lock died with it.
    assert (out / LOCK_FILE).is_file()
    run_cli("sft", *config_args("examples/debug/sft.toml", tiny_model_dir, out, "--max-steps", "2"))


def _children(pid: int) -> list[int]:
    tasks = f"/proc/{pid}/task/{pid}/children"
    with open(tasks) as file:
        return [int(child) for child in file.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_workers_exit_when_torchrun_is_killed(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            str(REPO / "scripts" / "sft.py"),
            *config_args("examples/debug/sft.toml", tiny_model_dir, out, "--max-steps", "100000"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        wait_for_rows(out / METRICS_FILE, 1, launcher)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)  # torchrun alone, not its process group
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "workers outlived their launcher"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


# `fnt` in a fresh interpreter; prints its exit status and whether torch was imported.
PROBE = """
import json, sys
from fnt.__main__ import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print(json.dumps({"code": exc.code, "torch": "torch" in sys.modules}))
"""


def test_a_busy_directory_is_refused_before_torch_is_imported(tiny_model_dir, tmp_path):
    """The command line takes the lock right after parsing, so a second run on a busy
    directory is refused in the time it takes to parse, whatever the first run is doing."""
    out = tmp_path / "run"
    held = lock_output_dir_(out)  # another open file: the probe's flock conflicts with it
    try:
        args = config_args("examples/debug/sft.toml", tiny_model_dir, out, "--resume", "latest")
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, "sft", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        held.close()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 2, "torch": False}
    assert "is in use by another run" in proc.stderr
