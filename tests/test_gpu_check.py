"""The CPU-runnable parts of scripts/gpu_check.sh: the script parses, names only files that exist,
and its throughput run works end to end at a tiny shape; the memory benchmark (slow) prints its
JSON line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_the_gpu_check_parses_and_runs_existing_parts():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for path in re.findall(r"scripts/\w+\.py", text):
        assert (REPO / path).is_file(), path
    assert '-m "gpu and not vllm"' in text  # the gpu-marked tests are the first part
    assert '-m "gpu and vllm"' in text and "bench_rl.py --engine vllm" in text


def test_each_call_of_the_gpu_check_fits_a_lent_machines_ten_minutes(tmp_path):
    """A lent GPU machine runs one command for at most 10 minutes: the time limits of each part
    (main, vllm) add up to 9 at most, and another part name is refused."""
    text = SCRIPT.read_text()
    main, vllm = text.split('elif [ "$PART" = vllm ]', 1)
    main = main.split('if [ "$PART" = main ]', 1)[1]
    for part in (main, vllm.split("\nelse\n")[0]):
        limits = [int(n) for n in re.findall(r"\btimeout (\d+) ", part)]
        assert limits and sum(limits) <= 9 * 60, limits
    out = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), "all"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "the part is main or vllm, not 'all'" in out.stderr


def run_json(*args: str, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_throughput_run_works_at_a_tiny_shape(tmp_path):
    result = run_json(
        "scripts/bench_throughput.py",
        "--tiny",
        "--steps",
        "2",
        "--work",
        str(tmp_path),
        timeout=300,
    )
    assert result["steps"] == 2 and result["attn_implementation"] == "sdpa"
    assert result["tokens_per_second"] > 0 and result["peak_memory_gib"] > 0


@pytest.mark.slow
def test_the_memory_benchmark_prints_its_json_line(tmp_path):
    result = run_json(
        "scripts/bench_memory.py",
        "--seq-lens",
        "256,512",
        "--skip-ranks",
        "--work",
        str(tmp_path),
        timeout=900,
    )
    assert set(result["steps"]) == {"256", "512"}
    for row in result["steps"].values():
        assert {"bare", "fnt_sft", "fnt_rl"} <= set(row)


@pytest.mark.slow
def test_the_compile_comparison_runs_at_a_tiny_shape(tmp_path):
    result = run_json(
        "scripts/bench_throughput.py",
        "--tiny",
        "--compile",
        "--steps",
        "3",
        "--work",
        str(tmp_path),
        timeout=600,
    )
    assert result["shape"] == "tiny" and result["steps"] == 3
    assert result["compile_seconds"] > 0 and result["compile_graphs"] >= 1
    assert result["eager_step_seconds"] > 0 and result["compiled_step_seconds"] > 0
    assert result["break_even_steps"] is None or result["break_even_steps"] >= 1


@pytest.mark.slow
def test_the_rl_compile_comparison_prints_its_json_line(tmp_path):
    result = run_json(
        "scripts/bench_rl.py",
        "--compile",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--work",
        str(tmp_path),
        timeout=600,
    )
    assert result["case"] == "compile" and result["steps"] == 2
    assert result["compile_seconds"] > 0 and result["compile_graphs"] >= 1
    for side in ("eager", "compiled"):
        assert result[f"{side}_rollout_s"] > 0 and result[f"{side}_update_s"] > 0
        assert result[f"{side}_generation_tok_s"] > 0
    assert result["break_even_steps"] is None or result["break_even_steps"] >= 1
