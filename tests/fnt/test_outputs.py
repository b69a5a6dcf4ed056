"""What commands write: whole or not at all (fnt.transaction.staged_dir_, staged_file_), and only
over what the same command wrote before (fnt.preflight's output rules)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fnt.errors import ConfigError
from fnt.store.paths import check_output_dir, check_output_file, require_run_output_dir
from fnt.store.rundir import LOCK_FILE, METRICS_FILE, ROLLOUTS_DIR
from fnt.store.transaction import output_marker, staged_dir_, staged_file_, written_by
from tests.e2e.helpers import REPO


def write_dir(out: Path, writer: str, files: dict[str, str]) -> None:
    with staged_dir_(out, output_marker(writer), "--out") as partial:
        for name, text in files.items():
            (partial / name).write_text(text)


def contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


def test_a_staged_directory_appears_whole_with_its_writer_named(tmp_path):
    out = tmp_path / "a" / "out"
    write_dir(out, "fnt export", {"config.json": "{}"})
    assert written_by(out) == "fnt export"
    assert contents(out).keys() == {"config.json", "COMPLETE"}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["out"]  # no out.partial


def test_an_error_while_writing_leaves_no_directory_and_removes_the_parents_it_made(tmp_path):
    out = tmp_path / "new" / "parents" / "out"
    with pytest.raises(RuntimeError, match="disk"):
        with staged_dir_(out, output_marker("w"), "--out") as partial:
            (partial / "weights").write_text("half")
            raise RuntimeError("disk")
    assert list(tmp_path.iterdir()) == []


def test_an_error_while_replacing_keeps_the_earlier_output(tmp_path):
    out = tmp_path / "out"
    write_dir(out, "w", {"a": "old"})
    with pytest.raises(RuntimeError):
        with staged_dir_(out, output_marker("w"), "--out") as partial:
            (partial / "a").write_text("new")
            raise RuntimeError("killed")
    assert contents(out)["a"] == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from fnt.store.transaction import output_marker, staged_dir_
with staged_dir_(Path(sys.argv[1]), output_marker("w"), "--out") as partial:
    (partial / "a").write_text("new")
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "replacing"])
def test_a_killed_writer_never_leaves_a_half_written_directory(tmp_path, earlier):
    out = tmp_path / "out"
    if earlier:
        write_dir(out, "w", {"a": "old"})
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (tmp_path / "out.partial" / "a").is_file()  # the kill left the staging directory
    if earlier:
        assert contents(out) == {"COMPLETE": output_marker("w"), "a": "old"}
    else:
        assert not out.exists()
    write_dir(out, "w", {"a": "next"})  # the next write clears what the kill left
    assert contents(out)["a"] == "next"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_uncreatable_directory_is_a_config_error_naming_the_option(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^--out '.*/file/out': cannot create .*out\.partial"):
        with staged_dir_(tmp_path / "file" / "out", output_marker("w"), "--out"):
            pass


def test_a_staged_file_replaces_the_old_one_only_when_written_whole(tmp_path):
    out = tmp_path / "plot.png"
    out.write_text("old")
    with pytest.raises(RuntimeError):
        with staged_file_(out, "--out") as partial:
            partial.write_text("half")
            raise RuntimeError("plot failed")
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    with staged_file_(out, "--out") as partial:
        partial.write_text("new")
    assert out.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def make_run_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / LOCK_FILE).write_text("")
    (path / METRICS_FILE).write_text("")
    (path / "checkpoints" / "step_2").mkdir(parents=True)
    return path


def situations(tmp_path: Path) -> dict[str, Path]:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    write_dir(tmp_path / "exported", "fnt export", {"config.json": "{}"})
    write_dir(tmp_path / "tiny", "fnt make-tiny-model", {"config.json": "{}"})
    run = make_run_dir(tmp_path / "run")
    return {
        "absent": tmp_path / "new" / "out",
        "empty": tmp_path / "empty",
        "earlier export": tmp_path / "exported",
        "another command's output": tmp_path / "tiny",
        "foreign": foreign,
        "a file": tmp_path / "a-file",
        "run directory": run,
        "inside a run's checkpoints": run / "checkpoints" / "hf",
        "the checkpoint read": run / "checkpoints" / "step_2",
        "holds the checkpoint read": tmp_path,
        "beside the run's files": run / "hf",
    }


# Whether `fnt export` (reading run/checkpoints/step_2) may write there: without --force, with it.
MAY_EXPORT = {
    "absent": (True, True),
    "empty": (True, True),
    "earlier export": (True, True),
    "another command's output": (False, True),
    "foreign": (False, True),
    "a file": (False, False),
    "run directory": (False, False),
    "inside a run's checkpoints": (False, False),
    "the checkpoint read": (False, False),
    "holds the checkpoint read": (False, False),
    "beside the run's files": (True, True),
}


@pytest.mark.parametrize("situation", list(MAY_EXPORT))
@pytest.mark.parametrize("force", [False, True], ids=["", "force"])
def test_an_output_directory_is_written_only_over_what_the_command_wrote(
    tmp_path, situation, force
):
    path = situations(tmp_path)[situation]
    keep = (tmp_path / "run" / "checkpoints" / "step_2",)
    allowed = MAY_EXPORT[situation][force]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    if allowed:
        check_output_dir(path, "--out", "fnt export", force=force, keep=keep)
    else:
        with pytest.raises(ConfigError, match=r"^--out '") as info:
            check_output_dir(path, "--out", "fnt export", force=force, keep=keep)
        assert "\n" not in str(info.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_refused_directory_is_named_with_what_is_there_and_the_ways_out(tmp_path):
    path = situations(tmp_path)["foreign"]
    with pytest.raises(ConfigError) as info:
        check_output_dir(path, "--out", "fnt export", force=False)
    message = str(info.value)
    assert "notes.txt" in message and "--force" in message and "new or empty" in message


def test_a_run_writes_where_no_file_of_its_names_is_someone_elses(tmp_path):
    places = situations(tmp_path)
    rollouts_only = tmp_path / "external"  # an orchestrator writes rollouts/ before the trainer
    (rollouts_only / ROLLOUTS_DIR).mkdir(parents=True)
    resolved = make_run_dir(tmp_path / "resolved")
    (resolved / "config.json").write_text(
        json.dumps({"output_dir": str(resolved), "model": {}, "max_steps": 2})
    )
    logged = tmp_path / "logged"  # a scheduler opened the job's log there before the run
    logged.mkdir()
    (logged / "slurm-17.out").write_text("")
    for ok in ("absent", "empty", "run directory"):
        require_run_output_dir(places[ok])
    for ok in (rollouts_only, resolved, logged, places["foreign"]):
        require_run_output_dir(ok)
    model = tmp_path / "model"
    make_run_dir(model)  # even among a run's files, a model's config.json is not the run's
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="^'output_dir' = .*config.json is not a run's config"):
        require_run_output_dir(model)
    with pytest.raises(ConfigError, match="^'output_dir' = .*: is a file, not a directory"):
        require_run_output_dir(places["a file"])


def test_an_output_file_is_replaced_only_when_the_command_signed_it(tmp_path):
    ours, theirs = tmp_path / "ours.png", tmp_path / "theirs.png"
    png = b"\x89PNG\r\n\x1a\n"

    def text_chunk(name: bytes, text: bytes) -> bytes:
        data = name + b"\0" + text
        return len(data).to_bytes(4, "big") + b"tEXt" + data + b"\0" * 4

    ours.write_bytes(png + text_chunk(b"Software", b"fnt plot") + b"\0\0\0\0IEND")
    theirs.write_bytes(png + text_chunk(b"Software", b"GIMP") + b"\0\0\0\0IEND")
    check_output_file(ours, "--out", "fnt plot", force=False)
    check_output_file(tmp_path / "new.png", "--out", "fnt plot", force=False)
    with pytest.raises(ConfigError, match="fnt plot did not write it"):
        check_output_file(theirs, "--out", "fnt plot", force=False)
    check_output_file(theirs, "--out", "fnt plot", force=True)
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_file(tmp_path, "--out", "fnt plot", force=True)
