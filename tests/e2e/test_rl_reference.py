"""The debug RL run gives the losses, rewards and weights recorded before the public-API refactor,
at 1 and 2 ranks (tests/e2e/data/rl_reference.json, made with `summarize` below).

Regenerate the file only for an intended change of the RL numbers (for example a new sampler),
and say so in the commit: python -m tests.e2e.test_rl_reference MODEL_DIR
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest

from fnt.monitors import read_metrics
from tests.e2e.helpers import config_args, model_weights, run_script

REFERENCE = Path(__file__).with_name("data") / "rl_reference.json"
ROW_KEYS = ("loss/mean", "reward/mean", "reward/std", "entropy/all/mean", "optim/grad_norm")
STEPS = 4
# One thread per rank: the float sums then do not depend on the machine's core count.
RUN_ARGS = ("--max-steps", str(STEPS), "--runtime.num-threads", "1")


def run_debug_rl(model_dir, out: Path, nproc: int) -> None:
    args = config_args("examples/debug/rl.toml", model_dir, out, *RUN_ARGS)
    run_script("rl.py", *args, nproc=nproc)


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


def assert_close(got: float, want: float, key: str) -> None:
    # The loss is a sum of advantages times ratios near 1: about 0, so it needs an absolute bound.
    assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-7), (key, got, want)


@pytest.mark.parametrize("nproc", [0, 2], ids=["1rank", "2ranks"])
def test_the_debug_rl_run_matches_the_recorded_reference(tiny_model_dir, tmp_path, nproc):
    want = json.loads(REFERENCE.read_text())["2ranks" if nproc else "1rank"]
    run_debug_rl(tiny_model_dir, tmp_path / "run", nproc)
    got = summarize(tmp_path / "run", tmp_path)
    assert len(got["rows"]) == len(want["rows"]) == STEPS
    for step, (row, expected) in enumerate(zip(got["rows"], want["rows"]), start=1):
        for key in ROW_KEYS:
            assert_close(row[key], expected[key], f"step {step} {key}")
    assert got["weights"].keys() == want["weights"].keys()
    for name, (total, squares) in got["weights"].items():
        assert_close(total, want["weights"][name][0], f"{name} sum")
        assert_close(squares, want["weights"][name][1], f"{name} sum of squares")


if __name__ == "__main__":
    model_dir = sys.argv[1]
    reference = {"recorded_with": "examples/debug/rl.toml " + " ".join(RUN_ARGS)}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, key in ((0, "1rank"), (2, "2ranks")):
            out = Path(tmp) / key
            run_debug_rl(model_dir, out, nproc)
            reference[key] = summarize(out, Path(tmp))
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")
