"""ckpt.keep_best: the best checkpoint by a row key (min, or "max:"), found from the rows and
checkpoints on disk, kept beside keep_last through every prune, named by `fnt inspect` and the
end summary; its config rules."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fnt.apps.inspect import format_summary, read_run, summary
from fnt.config import CkptConfig, Config, ConfigError, DataSourceConfig, ValConfig
from fnt.config.schema import keep_best_rule
from fnt.config.validation import validate
from fnt.obs.console import end_summary
from fnt.resume import resolve_resume_step
from fnt.store.best import best_checkpoint, best_step, best_text, prune_checkpoints_
from fnt.store.rundir import CHECKPOINTS_DIR, CONFIG_FILE, METRICS_FILE, steps_to_delete
from fnt.store.transaction import COMPLETE_MARKER


def test_the_rule_reads_min_by_default_and_max_with_its_prefix():
    assert keep_best_rule("val/loss") == ("val/loss", "min")
    assert keep_best_rule("min:val/loss") == ("val/loss", "min")
    assert keep_best_rule("max:val/reward/mean") == ("val/reward/mean", "max")


ROWS = {
    1: {"val/loss": 3.0, "acc": 0.1},
    2: {"acc": 0.5},  # not evaluated: no val/loss
    3: {"val/loss": 2.0, "acc": 0.5},
    4: {"val/loss": None, "acc": float("nan")},  # NaN is written as null
    5: {"val/loss": 2.0, "acc": 0.4},
}


def test_the_best_is_the_lowest_or_highest_finite_value_and_ties_keep_the_earlier_step():
    assert best_step(ROWS, [1, 2, 3, 4, 5], "val/loss").step == 3
    best = best_step(ROWS, [1, 2, 3, 4, 5], "max:acc")
    assert (best.step, best.value, best.mode) == (2, 0.5, "max")
    assert best_step(ROWS, [1, 4, 5], "val/loss").step == 5  # only existing checkpoints count
    assert best_step(ROWS, [2, 4], "val/loss") is None
    assert best_step(ROWS, [1, 3], "") is None


def test_pruning_never_removes_the_best():
    assert steps_to_delete([1, 2, 3, 4, 5], 2, keep=(1,)) == [2, 3]
    assert steps_to_delete([1, 2, 3, 4, 5], 2, keep=(5,)) == [1, 2, 3]
    assert steps_to_delete([1, 2, 3], 0, keep=(1,)) == []


def save(run: Path, step: int, row: dict) -> None:
    """What the loop does at a checkpointed step: the row, then the complete step_N."""
    with open(run / METRICS_FILE, "a") as fh:
        fh.write(json.dumps({"step": step, **row}) + "\n")
    path = run / CHECKPOINTS_DIR / f"step_{step}"
    path.mkdir(parents=True)
    (path / COMPLETE_MARKER).write_text(f"step {step}\n")


def complete(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / CHECKPOINTS_DIR).glob("step_*"))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep_best", ["val/loss", "max:val/loss"])
def test_saves_and_prunes_keep_the_newest_and_the_best_of_all_saved(tmp_path, seed, keep_best):
    rng = random.Random(seed)
    run, keep_last, values = tmp_path / "run", rng.randint(1, 3), {}
    run.mkdir()
    for step in range(1, 13):
        values[step] = rng.choice([1.0, 2.0, 3.0, 4.0, 5.0])  # ties happen
        save(run, step, {"val/loss": values[step]})
        prune_checkpoints_(run, keep_last, keep_best)
        # The best of every step saved so far, found from the directory alone (as after a resume).
        pick = min if keep_best == "val/loss" else max
        best = min(s for s in values if values[s] == pick(values.values()))
        assert complete(run) == sorted({best, *range(max(1, step - keep_last + 1), step + 1)})
        assert best_checkpoint(run, keep_best).step == best
        assert resolve_resume_step("latest", run / CHECKPOINTS_DIR) == step


def test_a_best_from_before_a_crash_survives_the_resumes_prunes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step, loss in [(1, 1.0), (2, 3.0), (3, 4.0)]:
        save(run, step, {"val/loss": loss})
        prune_checkpoints_(run, 1, "val/loss")
    # A crash cut the last line of metrics.jsonl; a resume's start prunes first.
    with open(run / METRICS_FILE, "a") as fh:
        fh.write('{"step": 4, "val/lo')
    prune_checkpoints_(run, 1, "val/loss")
    assert complete(run) == [1, 3]
    assert best_text(run, "val/loss") == "step_1 (val/loss 1, lowest)"
    assert best_text(run, "val/los") == "none (no checkpoint's row has a value of val/los)"
    assert best_text(run, "") is None


def test_inspect_names_the_best_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = {"output_dir": str(run), "max_steps": 3, "ckpt": {"keep_best": "max:acc"}}
    (run / CONFIG_FILE).write_text(json.dumps(cfg))
    for step, acc in [(1, 0.2), (2, 0.7), (3, 0.5)]:
        save(run, step, {"acc": acc})
    s = summary(read_run(run))
    assert s["best_checkpoint"] == {"step": 2, "key": "acc", "value": 0.7, "mode": "max"}
    assert "best         step_2 (acc 0.7, highest) (ckpt.keep_best; never pruned)" in (
        format_summary(s)
    )
    (run / CONFIG_FILE).write_text(json.dumps({"output_dir": str(run), "max_steps": 3}))
    assert summary(read_run(run))["best_checkpoint"] is None


def test_the_end_summary_names_the_best():
    first, last = {"step": 1, "loss/mean": 3.0}, {"step": 9, "loss/mean": 1.0}
    text = end_summary(first, last, 2.0, "step_9", "step_4 (val/loss 1.2, lowest)")
    assert text.endswith("| checkpoint step_9 | best step_4 (val/loss 1.2, lowest)")


VAL = ValConfig(sources=(DataSourceConfig(path="val.jsonl"),), interval=2)


@pytest.mark.parametrize(
    ("ckpt", "val", "message"),
    [
        (CkptConfig(interval=2, keep_best="max:"), VAL, "expected a row key"),
        (CkptConfig(interval=2, keep_best="mean:val/loss"), VAL, "expected a row key"),
        (CkptConfig(interval=0, keep_best="val/loss"), VAL, "saves only the final step"),
        (CkptConfig(interval=3, keep_best="val/loss"), VAL, "not a multiple of val.interval = 2"),
        (CkptConfig(interval=2, keep_best="val/loss"), ValConfig(), "val.interval = 0, so no"),
    ],
)
def test_a_keep_best_that_could_choose_nothing_is_refused(ckpt, val, message):
    with pytest.raises(ConfigError, match=message):
        validate(Config(ckpt=ckpt, val=val), 1)


def test_a_keep_best_that_can_choose_is_accepted():
    validate(Config(ckpt=CkptConfig(interval=4, keep_best="val/loss"), val=VAL), 1)
    validate(Config(ckpt=CkptConfig(interval=1, keep_best="max:loss/mean")), 1)
