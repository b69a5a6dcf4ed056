"""Runs `fnt` command lines, each in a fork of one torch-free process, and reports for each its
exit status, its output, which heavy modules it imported and which paths it changed: the harness
of the table-driven bad-input test (tests/e2e/test_bad_input.py).

    python -m tests.e2e.bad_input_probe JOBS.json RESULTS.json

JOBS.json holds {"roots": [DIR, ...], "jobs": [{"argv": [...], "cwd": DIR, "preload": bool}]};
RESULTS.json gets one {"code", "stdout", "stderr", "heavy", "changed"} per job, in order.

Why forks: a fresh interpreter per command costs a quarter of a second before fnt does anything,
and a module imported by the harness would hide the same import by the command. This process
imports fnt's command line only (which imports nothing heavy), so what a child has in
sys.modules beyond that, the command imported. Jobs with `preload` may build a model on the
meta device; the harness imports torch, transformers and peft once before the first of them
(jobs without it run first), and for those jobs checks the modules of fnt's model building and
training instead (`HEAVY`).

`changed` lists the paths under `roots` that were created, removed or altered (type, size,
modification time, or for files up to a MiB their contents) while the job ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from fnt.__main__ import main

# A command that did not need them must not have imported these: torch itself, and fnt's
# modules that build a model, start a process group or train.
HEAVY = (
    "torch",
    "transformers",
    "fnt.build",
    "fnt.model.loading",
    "fnt.distributed.runtime",
    "fnt.loop",
)
PRELOAD = ("torch", "transformers", "peft")
JOB_TIMEOUT_S = 120
HASHED_BYTES = 1 << 20


def snapshot(roots: list[str]) -> dict[str, tuple]:
    """(kind, size, mtime_ns, sha256 or None) of every path under `roots`, by path."""
    seen: dict[str, tuple] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                info = os.lstat(path)
                digest = None
                if os.path.isfile(path) and info.st_size <= HASHED_BYTES:
                    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                kind = "dir" if os.path.isdir(path) else "file"
                seen[path] = (kind, info.st_size, info.st_mtime_ns, digest)
    return seen


def changed(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return sorted(
        path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
    )


def run_child_(argv: list[str], cwd: str, scratch: Path) -> None:
    """In the forked child: run `fnt ARGV` with stdout and stderr in files of `scratch`, then
    write the exit status and the heavy modules it imported. Never returns."""
    try:
        os.chdir(cwd)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(scratch / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        signal.alarm(JOB_TIMEOUT_S)
        code = 0
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        heavy = [name for name in HEAVY if name in sys.modules]
        (scratch / "result.json").write_text(json.dumps({"code": code, "heavy": heavy}))
    finally:
        os._exit(0)


def run_job(job: dict, roots: list[str], scratch: Path) -> dict:
    before = snapshot(roots)
    pid = os.fork()
    if pid == 0:
        run_child_(job["argv"], job["cwd"], scratch)
    _, status = os.waitpid(pid, 0)
    after = snapshot(roots)
    result_file = scratch / "result.json"
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    else:  # killed: by the alarm, or by itself
        result = {"code": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else 1, "heavy": None}
    for name in ("stdout", "stderr"):
        path = scratch / name
        result[name] = path.read_text(errors="replace") if path.is_file() else ""
    result["changed"] = changed(before, after)
    return result


def main_(jobs_file: str, results_file: str) -> None:
    spec = json.loads(Path(jobs_file).read_text())
    already = [name for name in HEAVY if name in sys.modules]
    if already:
        raise SystemExit(f"the harness itself imported {already}: the probe would be blind")
    results: list = [None] * len(spec["jobs"])
    order = sorted(range(len(spec["jobs"])), key=lambda i: spec["jobs"][i]["preload"])
    for index in order:
        job = spec["jobs"][index]
        if job["preload"]:
            for name in PRELOAD:
                __import__(name)
        with tempfile.TemporaryDirectory() as scratch:
            results[index] = run_job(job, spec["roots"], Path(scratch))
    Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main_(*sys.argv[1:])
