"""The external rollout protocol with a real orchestrator in a separate process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.errors import DataError
from fnt.rollout.engines.external import parse_sample, rank_samples
from tests.e2e.helpers import REPO, config_args, read_metrics, run_cli, run_fnt

STEPS = 3


def rl_args(model_dir, out, *extra):
    return config_args(
        "examples/debug/rl.toml",
        model_dir,
        out,
        "--max-steps",
        str(STEPS),
        "--rollout.engine",
        "external",
        "--rollout.keep-weights",
        "2",
        "--batch-size",
        "2",
        "--micro-batch-size",
        "1",
        *extra,
    )


@pytest.mark.parametrize(
    "nproc", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
def test_trainer_and_orchestrator_exchange_rollouts_and_weights(tiny_model_dir, tmp_path, nproc):
    out = tmp_path / "run"
    orchestrator = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "e2e" / "orchestrator.py"),
            "--run",
            str(out),
            "--steps",
            str(STEPS),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        run_fnt("rl", *rl_args(tiny_model_dir, out), nproc=nproc)
        stdout, stderr = orchestrator.communicate(timeout=120)
    finally:
        orchestrator.kill()
    assert orchestrator.returncode == 0, stderr[-3000:]
    seen = json.loads(stdout.strip().splitlines()[-1])["seen"]
    assert [s["weights"] for s in seen] == [0, 1, 2]
    assert len({s["sha"] for s in seen}) == 3  # every step published new weights

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {
            "loss/mean",
            "reward/mean",
            "entropy/all/mean",
            "mismatch_kl/all/mean",
            "optim/grad_norm",
            "time/rollout",
            "time/after_step",
        } <= row.keys()
        assert row["mismatch_kl/all/mean"] == pytest.approx(0.0, abs=1e-4)  # same weights sampled
    # keep_weights = 2: only the newest two complete weight directories remain, and they load.
    weights = sorted(p.name for p in (out / "weights").iterdir())
    assert weights == ["step_2", "step_3"]
    model = AutoModelForCausalLM.from_pretrained(out / "weights" / "step_3")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_missing_rollouts_time_out_with_a_clear_error(tiny_model_dir, tmp_path):
    proc = run_cli(
        "rl", *rl_args(tiny_model_dir, tmp_path / "run", "--rollout.timeout-s", "1"), check=False
    )
    assert proc.returncode != 0
    assert "no rollouts after 1 s" in proc.stderr and "rollouts/step_1/COMPLETE" in proc.stderr
    assert (tmp_path / "run" / "weights" / "step_0" / "COMPLETE").is_file()


def test_malformed_sample_lines_name_the_line():
    with pytest.raises(DataError, match="f, line 3: missing 'advantage'"):
        parse_sample(json.dumps({"prompt_ids": [1], "completion_ids": [2]}), "f, line 3")
    with pytest.raises(DataError, match="one value per completion token"):
        parse_sample(
            json.dumps(
                {
                    "prompt_ids": [1],
                    "completion_ids": [2, 3],
                    "advantage": 1,
                    "inference_logprobs": [0.0],
                }
            ),
            "f, line 1",
        )
    with pytest.raises(DataError, match="do not split evenly over 2"):
        rank_samples([None, None, None], 0, 2, "f")
