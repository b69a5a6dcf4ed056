"""examples/reverse_text/compare_engines.py: the demo's RL stage at several seeds per engine,
from one SFT result, with per-engine means last (a short run: 2 RL steps)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO

EXAMPLE = REPO / "examples" / "reverse_text"
TINY = "--hidden-size 128 --intermediate-size 256 --layers 2 --heads 4 --kv-heads 2".split()


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """A runs dir laid out as the demo leaves it after SFT; the base model stands in for the
    SFT result (the script only needs its layout)."""
    runs = tmp_path_factory.mktemp("runs")
    model = runs / "reverse-model"
    scripts = [
        ["scripts/make_tiny_model.py", "--out", str(model), *TINY],
        [str(EXAMPLE / "make_data.py"), "--out", str(runs / "reverse-data")],
    ]
    for script in scripts:
        subprocess.run([sys.executable, *script], cwd=REPO, check=True, capture_output=True)
    shutil.copytree(model, runs / "reverse-sft-hf")
    return runs


def compare(runs, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "compare_engines.py"), "--runs", str(runs), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_runs(runs, result: dict, engines: list[str], seeds: list[int]) -> None:
    """One run per (seed, engine), each of 2 logged steps, and the means over its seeds."""
    assert [(r["engine"], r["seed"]) for r in result["runs"]] == [
        (e, s) for s in seeds for e in engines
    ]
    for engine in engines:
        scores = [r["rl_after"] for r in result["runs"] if r["engine"] == engine]
        summary = result["engines"][engine]
        assert summary["rl_after_mean"] == pytest.approx(statistics.fmean(scores))
        assert summary["gain_mean"] == pytest.approx(statistics.fmean(scores) - result["sft_after"])
        assert summary["std"] == pytest.approx(statistics.stdev(scores) if len(seeds) > 1 else 0)
        for seed in seeds:
            metrics = runs / "compare" / f"{engine}-{seed}" / "rl" / "metrics.jsonl"
            assert [json.loads(row)["step"] for row in metrics.read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_in_process_runs_at_each_seed_and_summarizes(demo_runs):
    result = compare(demo_runs, "--engines", "in_process", "--seeds", "1", "2", "--max-steps", "2")
    check_runs(demo_runs, result, ["in_process"], [1, 2])


def test_a_runs_dir_without_an_sft_result_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "compare_engines.py"), "--runs", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: {tmp_path} holds no demo SFT result: run demo.py --runs {tmp_path} --skip-rl"
    )


@pytest.mark.vllm
def test_both_engines_with_a_real_server(demo_runs):
    """The vLLM engine's run goes through the demo's own server start (`rl_with_vllm`)."""
    vllm = os.environ.get("FNT_VLLM", str(REPO / ".venv-vllm" / "bin" / "vllm"))
    result = compare(demo_runs, "--seeds", "3", "--max-steps", "2", "--vllm", vllm)
    check_runs(demo_runs, result, ["in_process", "vllm"], [3])
