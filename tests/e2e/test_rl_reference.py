"""The debug RL run: the numbers recorded in tests/e2e/data/rl_reference.json (a guard against a
refactor changing them), and 1 rank against 2 ranks in the same session.

Other CPUs round differently (another kernel family: FMA or not, other vector widths), and AdamW
turns last-bit differences of near-zero gradients into updates of the learning rate's size, so
a comparison with numbers recorded on another machine needs tolerances derived from how far
kernel families actually spread. `python -m tests.e2e.test_rl_reference spread MODEL_DIR` runs
the debug RL run under every ATEN_CPU_CAPABILITY this CPU supports, each with MKL's own dispatch
and with MKL_CBWR=COMPATIBLE and AVX2, at 1 and 2 ranks, and prints each quantity's widest
spread next to its tolerance. Measured on an AMD EPYC (AVX-512) with torch 2.13.0, over
default/avx2/avx512 x MKL auto/COMPATIBLE/AVX2 (18 runs, against the file recorded with
avx512 and MKL's own dispatch):

    row values (entropy, grad norm)          2.1e-7 relative   -> tolerance 2e-6
    loss/mean (a sum of terms near 0)        7.6e-8 absolute   -> tolerance 1e-6
    reward/mean, reward/std                  0 (the same samples: the sampler is exact)
    per tensor, sum of squares               3.8e-7 relative   -> tolerance 4e-6
    per tensor, sum / sqrt(sum of squares)   1.0e-5            -> tolerance 1e-4

The sums of squares are the sharp check (no cancellation); a sum nearly cancels, so its bound is
relative to the tensor's norm. Regenerate the file only for an intended change of the RL numbers
(for example a new sampler), and say so in the commit: python -m tests.e2e.test_rl_reference
record MODEL_DIR.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import config_args, model_weights, read_metrics, run_cli, run_script

pytestmark = pytest.mark.numerics

REFERENCE = Path(__file__).with_name("data") / "rl_reference.json"
ROW_KEYS = ("loss/mean", "reward/mean", "reward/std", "entropy/all/mean", "optim/grad_norm")
STEPS = 4
# One thread per rank: the float sums then do not depend on the machine's core count.
RUN_ARGS = ("--max-steps", str(STEPS), "--runtime.num-threads", "1")

ROW_RTOL = 2e-6
LOSS_ATOL = 1e-6  # loss/mean: advantages times ratios near 1 sum to about 0
SQUARES_RTOL = 4e-6
SUM_TO_NORM = 1e-4
# 1 rank against 2 ranks on one machine: the difference of the final weights relative to what
# training changed. Measured at most 3.7e-5 (avx512), 7.3e-6 (avx2) and 1.2e-5 (default): the
# rank split changes the reduction order of the loss sums, and AdamW amplifies that where
# gradients are near 0.
UPDATE_RTOL = 1e-3


def rl_args(model_dir, out: Path) -> tuple[str, ...]:
    return config_args("examples/debug/rl.toml", model_dir, out, *RUN_ARGS)


def run_debug_rl(model_dir, out: Path, nproc: int, env: dict[str, str] | None = None) -> None:
    run_script("rl.py", *rl_args(model_dir, out), nproc=nproc, env=env)


def summarize(out: Path, tmp: Path) -> dict:
    """The rows' key metrics and, per weight tensor, its sum and sum of squares (float64)."""
    weights = model_weights(out / "checkpoints" / f"step_{STEPS}", tmp)
    return {
        "rows": [{k: row[k] for k in ROW_KEYS} for row in read_metrics(out)],
        "weights": {
            name: [float(t.double().sum()), float(t.double().square().sum())]
            for name, t in sorted(weights.items())
        },
    }


def spreads(got: dict, want: dict) -> dict[str, float]:
    """The widest difference of each compared quantity, in the units of its tolerance."""
    rows = [(g, w) for g, w in zip(got["rows"], want["rows"], strict=True)]
    out = {
        "rows": max(
            abs(g[k] - w[k]) / max(abs(w[k]), 1e-30) for g, w in rows for k in ROW_KEYS[1:]
        ),
        "loss/mean": max(abs(g["loss/mean"] - w["loss/mean"]) for g, w in rows),
        "squares": 0.0,
        "sum_to_norm": 0.0,
    }
    for name, (total, squares) in got["weights"].items():
        want_total, want_squares = want["weights"][name]
        out["squares"] = max(out["squares"], abs(squares - want_squares) / want_squares)
        out["sum_to_norm"] = max(
            out["sum_to_norm"], abs(total - want_total) / math.sqrt(want_squares)
        )
    return out


TOLERANCES = {
    "rows": ROW_RTOL,
    "loss/mean": LOSS_ATOL,
    "squares": SQUARES_RTOL,
    "sum_to_norm": SUM_TO_NORM,
}


def two_rank_job(fixture, out):
    return {"call": "fnt.__main__:main", "args": [["rl", *rl_args(fixture("tiny_model_dir"), out)]]}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, two_rank_runs, tmp_path_factory) -> dict:
    """The debug RL run at 1 and 2 ranks, summarized, with the directory of each."""
    tmp = tmp_path_factory.mktemp("rl_reference")
    run_cli("rl", *rl_args(tiny_model_dir, tmp / "1rank"))
    dirs = {"1rank": tmp / "1rank", "2ranks": two_rank_runs(two_rank_job)}
    out = {key: {**summarize(run, tmp), "dir": run} for key, run in dirs.items()}
    return {**out, "tmp": tmp}


@pytest.mark.two_ranks(job=two_rank_job)
@pytest.mark.parametrize("key", ["1rank", "2ranks"])
def test_the_debug_rl_run_matches_the_recorded_reference(runs, key):
    want = json.loads(REFERENCE.read_text())[key]
    got = runs[key]
    assert len(got["rows"]) == len(want["rows"]) == STEPS
    assert got["weights"].keys() == want["weights"].keys()
    measured = spreads(got, want)
    for quantity, tolerance in TOLERANCES.items():
        assert measured[quantity] <= tolerance, (quantity, measured[quantity], tolerance)


@pytest.mark.two_ranks(job=two_rank_job)
def test_two_ranks_train_what_one_rank_trains(runs, tiny_model_dir):
    """Same machine, same session: the rows agree, and the final weights differ by a small
    fraction of what the four updates changed."""
    one, two = runs["1rank"], runs["2ranks"]
    measured = spreads(two, one)
    assert measured["rows"] <= ROW_RTOL and measured["loss/mean"] <= LOSS_ATOL, measured
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    w1, w2 = (
        model_weights(run["dir"] / "checkpoints" / f"step_{STEPS}", runs["tmp"])
        for run in (one, two)
    )
    for name, initial in start.items():
        update = (w1[name] - initial).double().norm()
        if update == 0:  # a tensor no update reached (e.g. an unused token's row alone)
            assert torch.equal(w1[name], w2[name]), name
            continue
        assert (w1[name] - w2[name]).double().norm() <= UPDATE_RTOL * update, name


def record(model_dir: str) -> None:
    reference = {"recorded_with": "examples/debug/rl.toml " + " ".join(RUN_ARGS)}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, key in ((0, "1rank"), (2, "2ranks")):
            out = Path(tmp) / key
            run_debug_rl(model_dir, out, nproc)
            reference[key] = summarize(out, Path(tmp))
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")


def spread(model_dir: str) -> None:
    """Run the debug RL run under every kernel family here; print each one's spreads against
    the recorded file and, last, one JSON line with the widest of each."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    families = ["default", "avx2", "avx512"]
    families = families[: families.index(best) + 1] if best in families else ["default"]
    recorded = json.loads(REFERENCE.read_text())
    widest = dict.fromkeys(TOLERANCES, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            for mkl in ("", "COMPATIBLE", "AVX2"):
                env = {"ATEN_CPU_CAPABILITY": family, **({"MKL_CBWR": mkl} if mkl else {})}
                for nproc, key in ((0, "1rank"), (2, "2ranks")):
                    out = Path(tmp) / f"{family}-{mkl or 'auto'}-{key}"
                    run_debug_rl(model_dir, out, nproc, env=env)
                    measured = spreads(summarize(out, Path(tmp)), recorded[key])
                    for quantity, value in measured.items():
                        widest[quantity] = max(widest[quantity], value)
                    print(out.name, json.dumps(measured), flush=True)
    print(json.dumps({"widest": widest, "tolerances": TOLERANCES, "cpu": os.uname().machine}))


if __name__ == "__main__":
    {"record": record, "spread": spread}[sys.argv[1]](sys.argv[2])
