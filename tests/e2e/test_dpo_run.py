"""`fnt dpo` end to end on the tiny model: one row per step with the preference metrics and
val/ on held-out pairs, bad input exits 2, exact resume after SIGKILL (1 and 2 ranks), 2 ranks
equal 1 rank, and the trained LoRA policy exports."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    read_metrics,
    run_cli,
    run_killed,
    run_script,
)

N = 6
VAL = (
    "--val.sources",
    json.dumps([{"path": "examples/debug/pairs_val.jsonl"}]),
    "--val.interval",
    "2",
)
LORA_PRECOMPUTED = ("--model.lora.rank", "4", "--dpo.precompute-reference")
PAIR_KEYS = (
    "loss/mean",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
VAL_KEYS = ("val/rewards/accuracies", "val/rewards/margins", "val/logps/chosen")
EXACT_KEYS = (*PAIR_KEYS, "optim/grad_norm", "progress/num_samples")


def assert_resumed_exactly(full, resumed, tmp_path):
    """Rows 5..N and the final weights of a run resumed at step 4 equal the uninterrupted
    run's, the val/ keys of the last row too."""
    assert_resumed_run_matches(full, resumed, 4, N, EXACT_KEYS, tmp_path)
    last_full, last_resumed = read_metrics(full)[-1], read_metrics(resumed)[-1]
    assert [last_resumed[k] for k in VAL_KEYS] == [last_full[k] for k in VAL_KEYS]


def dpo_args(model_dir, out, *extra):
    return config_args(
        "examples/debug/dpo.toml", model_dir, out, "--max-steps", str(N), *VAL, *extra
    )


@pytest.fixture(scope="module")
def one_rank_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo1") / "run"
    proc = run_cli("dpo", *dpo_args(tiny_model_dir, out, "--ckpt.interval", "2"))
    return out, proc


def test_one_row_per_step_with_the_pair_metrics_and_val_pairs(one_rank_run):
    out, proc = one_rank_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    for row in rows:
        assert set(PAIR_KEYS) <= row.keys()
        assert (set(VAL_KEYS) <= row.keys()) == (row["step"] % 2 == 0)
    assert rows[0]["loss/mean"] == pytest.approx(0.6931, abs=1e-4)  # the policy is the reference
    assert rows[-1]["loss/mean"] < rows[0]["loss/mean"]
    assert rows[-1]["rewards/margins"] > 0
    assert rows[-1]["progress/num_samples"] == sum(r["data/num_samples"] for r in rows)
    assert "step 6/6" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        (("--dpo.beta", "0"), "'dpo.beta' = 0.0: must be a finite number > 0"),
        (("--dpo.betta", "1"), "did you mean 'dpo.beta'"),
        (("--dpo.loss", "simpo", "--dpo.precompute-reference"), "reference-free"),
        (("--dpo.loss", "ipo", "--dpo.label-smoothing", "0.1"), "applies to dpo.loss"),
        (("--data.kind", "synthetic"), "fnt dpo trains on pairs"),
        (("--dpo.loss", "custom"), "'dpo.custom' = '': dpo.loss = \"custom\" needs"),
        (("--dpo.loss", "custom", "--dpo.custom", "math:nope"), "has no attribute 'nope'"),
    ],
    ids=lambda a: a[0][0] if isinstance(a, tuple) else a,
)
def test_a_bad_config_exits_2_with_one_line(tiny_model_dir, tmp_path, args):
    extra, message = args
    proc = run_cli("dpo", *dpo_args(tiny_model_dir, tmp_path / "run", *extra), check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stderr.startswith("error: "), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_bad_pair_line_is_named_before_the_model_loads(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p"}\n')
    sources = json.dumps([{"path": str(bad)}])
    proc = run_cli(
        "dpo", *dpo_args(tiny_model_dir, tmp_path / "run", "--data.sources", sources), check=False
    )
    assert proc.returncode == 2
    assert f"{bad}, line 2: a preference pair needs keys 'chosen' and 'rejected'" in proc.stderr
    assert "loading the model" not in proc.stdout


# "frozen copy" is slow for the default suite's time; the LoRA variant resumes the same loop.
@pytest.mark.parametrize(
    "variant", [pytest.param("frozen copy", marks=pytest.mark.slow), "lora, precomputed"]
)
def test_sigkill_then_resume_equals_the_uninterrupted_run(
    tiny_model_dir, tmp_path, one_rank_run, variant
):
    extra = ("--ckpt.interval", "2") + (LORA_PRECOMPUTED if variant != "frozen copy" else ())
    full = one_rank_run[0]
    if variant != "frozen copy":
        full = tmp_path / "full"
        run_cli("dpo", *dpo_args(tiny_model_dir, full, *extra))
    out = tmp_path / "killed"
    run_killed(*dpo_args(tiny_model_dir, out, *extra), fault="step@5", script="dpo.py")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    run_cli("dpo", *dpo_args(tiny_model_dir, out, *extra, "--resume", "latest"))
    assert_resumed_exactly(full, out, tmp_path)
    if variant != "frozen copy":
        exported = tmp_path / "merged"
        run_cli(
            "export",
            "--checkpoint",
            str(out / "checkpoints" / f"step_{N}"),
            "--out",
            str(exported),
            "--merge",
        )
        assert (exported / "config.json").is_file()
        inspected = run_cli("inspect", str(out), "--json")
        assert json.loads(inspected.stdout)["step"] == N


def two_rank_job(fixture, out):
    args = dpo_args(fixture("tiny_model_dir"), out / "run", "--ckpt.interval", "2")
    return {"call": "fnt.__main__:main", "args": [["dpo", *args]]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=two_rank_job)
def test_two_ranks_match_one_rank(one_rank_run, two_rank_runs):
    out1, _ = one_rank_run
    out2 = two_rank_runs(two_rank_job) / "run"
    rows1, rows2 = read_metrics(out1), read_metrics(out2)
    assert [r["step"] for r in rows2] == list(range(1, N + 1))
    for r1, r2 in zip(rows1, rows2):
        for key in (*PAIR_KEYS, "optim/grad_norm", *(k for k in VAL_KEYS if k in r1)):
            assert r2[key] == pytest.approx(r1[key], abs=1e-5), (r1["step"], key)
        assert r2["progress/num_samples"] == r1["progress/num_samples"]


@pytest.mark.slow
def test_two_rank_sigkill_then_resume_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    def dpo(out, *extra):
        run_script(
            "dpo.py", *dpo_args(tiny_model_dir, out, "--ckpt.interval", "2", *extra), nproc=2
        )

    full = tmp_path / "full"
    dpo(full)
    out = tmp_path / "killed"
    run_killed(
        *dpo_args(tiny_model_dir, out, "--ckpt.interval", "2"),
        fault="step@5:1",
        nproc=2,
        script="dpo.py",
    )
    dpo(out, "--resume", "latest")
    assert_resumed_exactly(full, out, tmp_path)
