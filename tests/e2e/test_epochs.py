"""max_epochs end to end on the tiny model: SFT and DPO resolve it to the step count that makes
exactly that many passes over the data, say so at the start, record it in config.json and the
checkpoints, and a resumed run keeps it (its rows and weights equal the uninterrupted run's)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
)


def reverse_records(count: int) -> list[dict]:
    """Reverse-the-word prompt/completion samples of a few lengths."""
    words = [
        "".join("abcdefghij"[(i * 7 + j) % 10] for j in range(3 + i % 5)) for i in range(count)
    ]
    return [{"prompt": f"reverse {w}", "completion": w[::-1]} for w in words]


def sft_args(model_dir, data, out, *extra):
    return config_args(
        "examples/debug/sft.toml",
        model_dir,
        out,
        "--data.kind",
        "sources",
        "--data.sources",
        json.dumps([{"path": str(data)}]),
        "--batch-size",
        "2",
        "--micro-batch-size",
        "2",
        *extra,
    )


def assert_epochs_exact(rows: list[dict], epochs: int) -> None:
    """The last step reaches `epochs` passes over the data and the step before it had not."""
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["progress/epoch"] == epochs, rows[-1]
    assert rows[-2]["progress/epoch"] < epochs, rows[-2]


def recorded_max_steps(path) -> int:
    return json.loads(path.read_text())["max_steps"]


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reverse_records(30)))
    out = root / "run"
    # examples/debug/sft.toml sets max_steps = 20: max_epochs on the command line wins.
    args = sft_args(tiny_model_dir, data, out, "--max-epochs", "2", "--ckpt.interval", "2")
    proc = run_cli("sft", *args)
    return data, out, proc


def test_sft_max_epochs_resolves_to_the_steps_of_exactly_that_many_passes(sft_run):
    _, out, proc = sft_run
    rows = read_metrics(out)
    steps = len(rows)
    assert steps != 20 and steps >= 3  # not the file's max_steps
    assert_epochs_exact(rows, 2)
    assert f"max_epochs 2 resolved to {steps} steps" in proc.stdout, proc.stdout
    assert recorded_max_steps(out / "config.json") == steps
    assert recorded_max_steps(out / "checkpoints" / f"step_{steps}" / "config.json") == steps


def test_a_resumed_epoch_run_keeps_its_step_count_and_equals_the_uninterrupted_run(
    sft_run, tiny_model_dir, tmp_path
):
    data, full, _ = sft_run
    steps = len(read_metrics(full))
    crashed = tmp_path / "run"
    copy_crashed_run(full, crashed, 2)
    args = sft_args(tiny_model_dir, data, crashed, "--max-epochs", "2", "--ckpt.interval", "2")
    proc = run_cli("sft", *args, "--resume", "latest")
    assert "resume: max_steps" not in proc.stdout, proc.stdout
    # optim/lr follows the cosine schedule over max_steps: equal rows mean equal step counts.
    keys = ("loss/mean", "optim/lr", "optim/grad_norm", "progress/epoch")
    assert_resumed_run_matches(full, crashed, 2, steps, keys, tmp_path)


def test_dpo_max_epochs_counts_passes_over_the_pairs(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "dpo", *config_args("examples/debug/dpo.toml", tiny_model_dir, out, "--max-epochs", "1")
    )
    rows = read_metrics(out)
    assert_epochs_exact(rows, 1)
    assert f"max_epochs 1 resolved to {len(rows)} steps" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--max-steps", "5", "--max-epochs", "2"), "both set the run's length: give one"),
        (("--max-epochs", "1"), "data.kind = 'synthetic' is endless"),
        (("--ckpt.keep-best", "val/loss", "--ckpt.interval", "2"), "val.interval = 0, so no"),
    ],
)
def test_a_bad_length_or_keep_best_exits_2_with_one_line(tmp_path, extra, message):
    args = ("--config", "examples/debug/sft.toml", "--output-dir", str(tmp_path / "run"), *extra)
    proc = run_cli("sft", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
