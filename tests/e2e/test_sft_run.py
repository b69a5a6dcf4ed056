"""The SFT script end to end: one process and two ranks under torchrun, on the tiny model."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.e2e.helpers import config_args, read_metrics, run_cli

REQUIRED_KEYS = {
    "step",
    "time",
    "perf/throughput",
    "perf/throughput_per_rank",
    "perf/mfu",
    "perf/peak_memory",
    "optim/lr",
    "optim/grad_norm",
    "system/ckpt_disk_free_gib",
    "system/ckpt_disk_used_gib",
    "system/ckpt_disk_total_gib",
    "system/ckpt_disk_free_ratio",
    "loss/mean",
    "loss/perplexity",
    "loss/nan_count",
    "time/step",
    "time/forward_backward",
    "time/save_ckpt",
    "progress/epoch",
    "progress/num_samples",
    "progress/num_tokens",
}


def sft_args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, *extra)


def assert_chrome_trace(path):
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]


@pytest.fixture(scope="module")
def one_rank_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft1")
    proc = run_cli(
        "sft",
        *sft_args(tiny_model_dir, out, "--max-steps", "5", "--trace-path", str(out / "trace")),
    )
    return out, proc


def two_rank_job(fixture, out):
    run = out / "run"
    args = sft_args(fixture("tiny_model_dir"), run, "--max-steps", "5", "--trace-path")
    return {"call": "fnt.__main__:main", "args": [["sft", *args, str(run / "trace")]]}


def test_one_process_writes_one_row_per_step_and_a_trace(one_rank_run):
    out, proc = one_rank_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert REQUIRED_KEYS <= row.keys(), REQUIRED_KEYS - row.keys()
    assert rows[-1]["progress/num_tokens"] == 5 * 8 * 64
    assert_chrome_trace(out / "trace" / "trace_0.json.gz")
    config = json.loads((out / "config.json").read_text())
    assert config["max_steps"] == 5 and config["output_dir"] == str(out)
    assert "step 5/5" in proc.stdout  # the console line


@pytest.mark.numerics
@pytest.mark.two_ranks(job=two_rank_job)
def test_two_ranks_match_one_rank_and_only_rank0_writes(one_rank_run, two_rank_runs):
    out1, _ = one_rank_run
    job = two_rank_runs(two_rank_job)
    out2 = job / "run"
    rows1, rows2 = read_metrics(out1), read_metrics(out2)
    assert [r["step"] for r in rows2] == [1, 2, 3, 4, 5]
    for r1, r2 in zip(rows1, rows2):
        assert r2["loss/mean"] == pytest.approx(r1["loss/mean"], abs=1e-5)
        assert r2["optim/grad_norm"] == pytest.approx(r1["optim/grad_norm"], abs=1e-5)
        assert r2["optim/lr"] == r1["optim/lr"]
        assert r2["progress/num_samples"] == r1["progress/num_samples"]
    # The console line comes from rank 0 only.
    assert (job / "rank0.log").read_text().count("step 3/5") == 1
    assert "step 3/5" not in (job / "rank1.log").read_text()
    assert_chrome_trace(out2 / "trace" / "trace_0.json.gz")
    assert_chrome_trace(out2 / "trace" / "trace_1.json.gz")


def test_a_fresh_start_refuses_an_earlier_runs_checkpoints(one_rank_run, tiny_model_dir):
    out, _ = one_rank_run
    proc = run_cli("sft", *sft_args(tiny_model_dir, out, "--max-steps", "5"), check=False)
    assert proc.returncode == 2
    assert "already holds checkpoints of an earlier run (steps 5)" in proc.stderr
    assert "--resume latest" in proc.stderr
