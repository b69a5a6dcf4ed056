"""The decisions fnt documents as pure touch no file: the resume decision, config
reconciliation, the row's merge and the repair of metrics rows. Each runs here in a fresh
interpreter with an audit hook that records every file the process opens or lists, and a
read-only working directory."""

from __future__ import annotations

import json
import subprocess
import sys

import fnt.obs.metrics
import fnt.obs.monitors.jsonl
import fnt.resume

PURE = {
    "fnt.resume:choose_resume_step": fnt.resume.choose_resume_step,
    "fnt.resume:reconcile_config": fnt.resume.reconcile_config,
    "fnt.obs.metrics:step_row": fnt.obs.metrics.step_row,
    "fnt.obs.metrics:merge_metrics": fnt.obs.metrics.merge_metrics,
    "fnt.obs.monitors.jsonl:repair_rows": fnt.obs.monitors.jsonl.repair_rows,
}

# Imports first (they read files); then, under the hook, each function on typical inputs.
PROBE = """
import json, sys
from fnt.config import Config, to_plain
from fnt.obs.metrics import merge_metrics, step_row
from fnt.obs.monitors.jsonl import repair_rows
from fnt.resume import choose_resume_step, reconcile_config

touched, watching = [], [False]

def hook(event, args):
    if watching[0] and (event == "open" or event.startswith(("os.", "shutil."))):
        touched.append(event + " " + repr(args)[:80])

sys.addaudithook(hook)
saved, current = to_plain(Config()), to_plain(Config(max_steps=7))
lines = ['{"step": 1, "loss/mean": 2.0}\\n', '{"step": 1, "loss/me', '{"step": 2}\\n']
watching[0] = True
choose_resume_step("latest", [2, 4])
reconcile_config(saved, current)
step_row(3, 1.5, {"perf/throughput": 10.0}, merge_metrics({"loss/mean": 1.0}, {"x": 2.0}))
repair_rows(lines, 2)
watching[0] = False
print(json.dumps(touched))
"""


def test_the_pure_decisions_are_documented_as_pure():
    for name, fn in PURE.items():
        assert "Pure." in (fn.__doc__ or ""), f"{name} does not say it is pure"


def test_the_pure_decisions_touch_no_file(tmp_path):
    tmp_path.chmod(0o555)  # nothing can be written where the probe runs
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True
        )
    finally:
        tmp_path.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_audit_hook_sees_a_file_being_opened(tmp_path):
    """The probe would notice an impure decision: the same hook records a file's open."""
    probe = PROBE.replace("repair_rows(lines, 2)", "open('x.jsonl', 'a')")
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(event.startswith("open") for event in json.loads(done.stdout.splitlines()[-1]))
