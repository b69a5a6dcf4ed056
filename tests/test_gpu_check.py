"""scripts/gpu_check.sh and what it runs, on CPU: the script parses, is one call whose parts'
time limits fit a lent machine's ten minutes, installs its wheels offline and names only files
that exist; their pure parts (the rows, the trace's counts) hold. The peers benchmark and the
profiled steps run end to end at their --tiny settings in the slow suite (about 15 and 6 s,
the default suite's largest file otherwise: a developer's tool, whose parts are tested here),
and so do the benchmarks it ran before (throughput, memory, compile)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def test_the_gpu_check_parses_and_runs_existing_parts():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    scripts = set(re.findall(r"scripts/\w+\.py", text))
    for path in scripts:
        assert (REPO / path).is_file(), path
    assert {"scripts/bench_peers.py", "scripts/profile_step.py"} <= scripts
    assert '-m "gpu and not vllm"' in text  # the gpu-marked tests, vLLM's left out
    assert '"gpu and vllm"' not in text and "--engine vllm" not in text  # no vLLM part
    assert "FNT_GPU_CHECK_TINY=1" in text.split("set -uo pipefail")[0]  # the dry run, documented


def test_the_gpu_check_is_one_call_that_fits_a_lent_machines_ten_minutes():
    """A lent GPU machine runs one command for at most 10 minutes: every part runs under
    run_part's limit (nothing under a timeout of its own), and the limits add up to 9 at most;
    the headline, the peers at seq_len 8192, comes first."""
    text = SCRIPT.read_text()
    parts = re.findall(r"^run_part (\w+) (\d+) ", text, flags=re.M)
    assert parts and parts[0][0] == "peers_8192", parts
    assert sum(int(seconds) for _, seconds in parts) <= 9 * 60, parts
    assert len({name for name, _ in parts}) == len(parts)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    timeouts = [line for line in code if re.search(r"(?<![-\w])timeout ", line)]
    assert timeouts == ['  timeout -s KILL "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"']


def test_the_gpu_check_installs_its_wheels_offline_and_imports_the_checkout():
    text = SCRIPT.read_text()
    install = next(line for line in text.splitlines() if "pip install" in line)
    for flag in ("--no-index", "--no-deps", "--no-compile", "--target", ".gpu-wheels/*.whl"):
        assert flag in install, flag
    assert "SITE=${FNT_GPU_SITE:-/tmp/fnt-site}" in text
    assert "export PYTHONPATH=$PWD:$SITE" in text
    makefile = (REPO / "Makefile").read_text()
    assert "gpu-wheels:" in makefile and "--no-deps" in makefile
    assert ".gpu-wheels/" in (REPO / ".gitignore").read_text().splitlines()


# The packages a lent GPU machine's image is known to have (Python 3.12, torch 2.11, no registry);
# with what they require, the wheels of `make gpu-wheels` must supply everything else.
GPU_IMAGE = (
    "torch transformers accelerate huggingface-hub safetensors tokenizers numpy triton peft "
    "pytest hypothesis pyarrow pandas xxhash jinja2 requests tqdm pyyaml psutil rich"
).split()
# Extras and tools that image lacks: no test module may import them when it is loaded, or
# `pytest -m gpu tests` stops at a collection error before running any gpu test.
NOT_IN_GPU_IMAGE = {"matplotlib", "reasoning_gym", "verifiers", "vllm", "wandb", "ruff"}


def _requirements(name: str) -> list[str]:
    """The distribution's unconditional requirements (no extras), by normalised name; [] when it
    is not installed here."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        texts = requires(name) or []
    except PackageNotFoundError:
        return []
    found = []
    for text in texts:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            found.append(canonicalize_name(requirement.name))
    return found


def test_the_gpu_wheels_bring_what_they_require_beyond_the_image():
    """Every requirement of a pinned wheel (as installed here) is pinned too or comes with the
    image: dataclasses-json's typing-inspect did not, and fnt could not be imported there."""
    from packaging.utils import canonicalize_name

    makefile = (REPO / "Makefile").read_text()
    pins_text = re.search(r"^GPU_WHEEL_PINS = ((?:.*\\\n)*.*)$", makefile, flags=re.M).group(1)
    pins = {canonicalize_name(p.split("==")[0]) for p in pins_text.replace("\\", " ").split()}
    assert {"dataclasses-json", "typing-inspect", "trl", "ninja"} <= pins, pins
    image, todo = set(), [canonicalize_name(n) for n in GPU_IMAGE]
    while todo:
        name = todo.pop()
        if name not in image:
            image.add(name)
            todo.extend(_requirements(name))
    missing = {(pin, r) for pin in pins for r in _requirements(pin) if r not in pins | image}
    assert not missing, missing


def test_no_test_module_imports_what_the_gpu_image_lacks_when_loaded():
    import ast

    collected = [*(REPO / "tests").rglob("test_*.py"), *(REPO / "tests").rglob("conftest.py")]
    for path in sorted(collected):  # the files pytest imports (helpers are imported lazily)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in NOT_IN_GPU_IMAGE, (path, name)


def test_a_gpu_tests_subprocess_keeps_the_site_folder_on_its_path(tmp_path, monkeypatch):
    """On the GPU machine fnt's dependencies (dataclasses-json) lie in the check's site folder on
    PYTHONPATH: the runs a gpu test starts (run_script) keep it there, after the checkout."""
    from tests.e2e.helpers import run_script

    site = tmp_path / "site"
    monkeypatch.setenv("PYTHONPATH", str(site))
    script = tmp_path / "path.py"
    script.write_text("import os; print(os.environ['PYTHONPATH'])")
    printed = run_script(str(script)).stdout.strip()
    assert printed.split(":") == [str(REPO), str(site)]


def test_the_peers_rows_are_exactly_seq_len_tokens_of_one_document(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from scripts.bench_peers import write_rows

    chats, token_ids = write_rows(tmp_path, tiny_model_dir, 64, 3)
    ids = json.loads(token_ids.read_text())
    records = [json.loads(line) for line in chats.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(ids) == len(records) == 3 and len(set(map(tuple, ids))) == 3
    for row, record in zip(ids, records):
        (message,) = record["messages"]
        assert len(row) == 64
        assert tokenizer(message["content"], add_special_tokens=False)["input_ids"] == row


def test_the_profile_counts_kernels_and_host_syncs_per_step():
    """scripts/profile_step.py's reading of a CUDA trace: kernels ranked by device time, each
    sync op, runtime sync and device-to-host copy counted per step, the window's own
    cudaDeviceSynchronize left out."""
    from scripts.profile_step import summarize

    def event(cat, name, dur=1.0):
        return {"ph": "X", "cat": cat, "name": name, "dur": dur}

    events = [
        *[event("kernel", "gemm", 300.0)] * 4,
        *[event("kernel", "softmax", 100.0)] * 2,
        {"ph": "i", "cat": "kernel", "name": "instant"},
        *[event("cpu_op", "aten::_local_scalar_dense")] * 4,
        *[event("cpu_op", "aten::item")] * 4,
        event("cpu_op", "aten::mm"),
        *[event("cuda_runtime", "cudaStreamSynchronize")] * 4,
        *[event("cuda_runtime", "cudaDeviceSynchronize")] * 3,
        *[event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)")] * 2,
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)"),
    ]
    summary = summarize(events, steps=2, cpu_ops=[], top=1, cuda=True)
    assert summary["top_of"] == "kernels by device time"
    (top,) = summary["top"]
    assert top["name"] == "gemm" and top["calls_per_step"] == 2
    assert top["ms_per_step"] == pytest.approx(0.6) and top["share"] == pytest.approx(0.857, 1e-3)
    assert summary["device_ms_per_step"] == pytest.approx(0.7)
    per_step = summary["syncs_per_step"]
    assert per_step["aten::_local_scalar_dense"] == per_step["aten::item"] == 2
    assert per_step["cudaStreamSynchronize"] == 2 and per_step["cudaDeviceSynchronize"] == 1
    assert per_step["Memcpy DtoH"] == 1 and per_step["aten::nonzero"] == 0
    assert summary["host_syncs_per_step"] == 3  # stream + device synchronizes
    on_cpu = summarize(events[7:16], 2, [("aten::mm", 50.0, 4)], top=15, cuda=False)
    assert on_cpu["top_of"] == "CPU ops by self time" and on_cpu["top"][0]["name"] == "aten::mm"
    assert on_cpu["host_syncs_per_step"] == 2  # aten::_local_scalar_dense + aten::nonzero


def test_the_peers_fnt_side_falls_back_to_sdpa_once_when_its_settings_fail(monkeypatch):
    """A new kernel that fails on the lent GPU still leaves fnt's numbers: one more run with
    FALLBACK_ARGS, the first failure kept in the JSON; a failing fallback is the side's
    failure."""
    import scripts.bench_peers as peers

    calls, logs = [], []

    def run_fnt(spec, timeout):
        calls.append(spec["fnt_args"])
        logs.append(spec.get("log", "fnt.log"))
        if spec["fnt_args"] != peers.FALLBACK_ARGS or fallback_fails:
            raise RuntimeError(f"fnt sft exited 1: boom {len(calls)}")
        return {"step_times": [1.0]}

    monkeypatch.setattr(peers, "run_fnt", run_fnt)
    fallback_fails = False
    result: dict = {}
    asked = ["--model.compile", "true"]
    assert peers.measure_fnt({"fnt_args": asked}, 10.0, result) == {"step_times": [1.0]}
    assert calls == [asked, peers.FALLBACK_ARGS]
    assert logs == ["fnt.log", "fnt-fallback.log"]
    assert result["fnt_failed"] == "with --model.compile true: fnt sft exited 1: boom 1"
    fallback_fails, result = True, {}
    with pytest.raises(RuntimeError, match="boom 4"):
        peers.measure_fnt({"fnt_args": []}, 10.0, result)
    assert calls[2:] == [[], peers.FALLBACK_ARGS]
    assert result["fnt_failed"].startswith("with the defaults: ")


def test_the_peers_exit_status_counts_failures_and_timeouts_not_a_missing_trl():
    import scripts.bench_peers as peers

    measured = {"fnt": {"step_s": 1.0}, "bare": {"step_s": 1.0}}
    assert not peers.any_side_failed({**measured, "trl": "not measured: trl is not importable"})
    assert peers.any_side_failed({**measured, "trl": "not measured: timed out after 90 s"})
    assert peers.any_side_failed({**measured, "trl": "failed: TRL exited 1"})
    assert peers.any_side_failed({**measured, "fnt_failed": "with the defaults: boom"})


def run_json(*args: str, timeout: float, returncode: int = 0) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == returncode, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_peers_benchmark_runs_at_a_tiny_shape(tmp_path):
    """fnt and the bare loop train the same rows: the same first loss; TRL, where this
    interpreter cannot import it, is a reason string rather than a crash."""
    result = run_json("scripts/bench_peers.py", "--tiny", "--work", str(tmp_path), timeout=600)
    assert result["complete"] and result["shape"] == "tiny" and result["seq_len"] == 256
    assert result["steps"] == 3 and result["warmup"] == 2
    fnt, bare = result["fnt"], result["bare"]
    for side in (fnt, bare):
        assert side["step_s"] > 0 and side["tokens_per_s"] == pytest.approx(256 / side["step_s"])
        assert side["peak_memory_gib"] > 0 and "mfu" in side
    assert fnt["loss_first_last"][0] == pytest.approx(bare["loss_first_last"][0], abs=1e-3)
    assert fnt["attn_implementation"] and "compile" in fnt and fnt["tokens_per_step"] == [256]
    assert result["fnt_over_bare"] == pytest.approx(
        fnt["tokens_per_s"] / bare["tokens_per_s"], abs=1e-3
    )
    if isinstance(result["trl"], str):
        assert result["trl"].startswith("not measured") and "fnt_over_trl" not in result
    else:
        assert result["trl"]["step_s"] > 0 and result["fnt_over_trl"] > 0


@pytest.mark.slow
def test_the_peers_fnt_side_measured_with_sdpa_where_the_kernel_asked_for_cannot_run(tmp_path):
    """On a CPU the varlen kernel cannot run: fnt's side says so and is measured with sdpa."""
    result = run_json(
        "scripts/bench_peers.py", "--tiny", "--steps", "2", "--warmup", "1", "--sides", "fnt",
        "--fnt-args", "--model.attn-implementation varlen", "--work", str(tmp_path), timeout=600,
        returncode=1,  # fnt failed with what was asked: the GPU check's summary shows it
    )  # fmt: skip
    assert "model.attn_implementation" in result["fnt_failed"], result["fnt_failed"]
    assert result["fnt_failed"].startswith("with --model.attn-implementation varlen: ")
    assert result["fnt"]["attn_implementation"] == "sdpa" and result["fnt"]["step_s"] > 0
    assert (tmp_path / "seq256" / "fnt.log").is_file()
    assert (tmp_path / "seq256" / "fnt-fallback.log").is_file()


@pytest.mark.slow
def test_the_profiled_steps_run_at_a_tiny_shape(tmp_path):
    result = run_json("scripts/profile_step.py", "--tiny", "--work", str(tmp_path), timeout=600)
    assert result["bench"] == "profile_step" and result["device"] == "cpu"
    assert result["warmup"] == 1 and result["steps"] == 2 and len(result["step_s"]) == 2
    assert result["top_of"] == "CPU ops by self time" and 0 < len(result["top"]) <= 15
    assert result["top"][0]["ms_per_step"] >= result["top"][-1]["ms_per_step"] > 0
    assert set(result["syncs_per_step"]) >= {"aten::_local_scalar_dense", "Memcpy DtoH"}
    assert result["host_syncs_per_step"] >= 1  # at least the step's metrics coming back
    assert Path(result["trace"]).is_file()


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
