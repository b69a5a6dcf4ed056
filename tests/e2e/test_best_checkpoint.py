"""ckpt.keep_best in real runs: the best checkpoint by a row key stays beside keep_last, a run
killed and resumed continues from the newest checkpoint (not the best) and still keeps the best
found before the kill, and the end summary and `fnt inspect` name it."""

from __future__ import annotations

import json

from tests.e2e.helpers import config_args, read_metrics, run_cli, run_killed

# The tiny model's loss falls from step 1 on, so "max:loss/mean" makes step 1 the best: a
# checkpoint keep_last = 1 alone would have deleted at step 2.
BEST = ("--ckpt.interval", "1", "--ckpt.keep-last", "1", "--ckpt.keep-best", "max:loss/mean")


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", "6", *BEST, *extra)


def checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def test_the_best_survives_keep_last_a_kill_and_the_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out), fault="step@4")
    assert checkpoints(out) == ["step_1", "step_3"]

    proc = run_cli("sft", *args(tiny_model_dir, out, "--resume", "latest"))
    assert "(from step 3, to step 6)" in proc.stdout  # the newest, not the best
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert max(rows, key=lambda r: r["loss/mean"])["step"] == 1
    assert checkpoints(out) == ["step_1", "step_6"]
    loss = f"{rows[0]['loss/mean']:.4g}"
    assert f"| checkpoint step_6 | best step_1 (loss/mean {loss}, highest)" in proc.stdout

    inspect = run_cli("inspect", str(out), "--json")
    assert json.loads(inspect.stdout)["best_checkpoint"]["step"] == 1
