"""A command that fails before step 1 leaves the output directory as it found it (issue 45.4):
a new directory is removed with the parents it needed (run.lock, data_cache/, config.json and
an empty metrics.jsonl with it), and an existing run directory stays byte for byte as it was
after a failed resume. The rules of the record are tests/fnt/test_failed_start.py's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from fnt.config import Config, load_config
from fnt.store.rundir import LOCK_FILE
from tests.e2e.helpers import REPO, config_args, run_cli

SFT, RL, DPO = (f"examples/debug/{name}.toml" for name in ("sft", "rl", "dpo"))
GOOD = {"prompt": "count to 3", "completion": " 1 2 3"}


def one_error_line(proc) -> str:
    """The error of a bad input: exit 2, no traceback, stderr starting with `error: ` (a data
    error's message lists its bad records on the lines below)."""
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return path


def contents(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`: a file's bytes, None for a directory."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def damaged_model(tiny_model_dir, tmp_path) -> Path:
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "truncated-model"))
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[: len(text) // 2])
    return model


def sft_args(model, out, data: Path, *extra: str) -> tuple[str, ...]:
    sources = json.dumps([{"path": str(data)}])
    return config_args(SFT, model, out, "--data.kind", "sources", "--data.sources", sources,
                       *extra)  # fmt: skip


def test_failed_starts_leave_no_new_directory(tiny_model_dir, damaged_model, tmp_path):
    # A bad line after the first is met while the data is tokenized, under the lock: it has made
    # run.lock (and data_cache/) by then; the others fail before, in the start-up checks.
    bad_sft = write_jsonl(tmp_path / "sft.jsonl", [GOOD, GOOD, '{"prompt": 3}\n'])
    pairs = (REPO / "examples/debug/pairs.jsonl").read_text().splitlines(keepends=True)
    bad_pairs = write_jsonl(tmp_path / "pairs.jsonl", [*pairs[:3], '{"prompt": "x"}\n'])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, '{"messages": 3}\n'])
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD] * 4)
    pair_sources = json.dumps([{"path": str(bad_pairs)}])
    model = str(tiny_model_dir)
    cases = {
        "a bad data line": ("sft", sft_args(model, "OUT", bad_sft), "sft.jsonl, line 3"),
        "a bad pair line": (
            "dpo",
            config_args(DPO, model, "OUT", "--data.sources", pair_sources),
            "pairs.jsonl, line 4",
        ),
        "a bad prompt line": (
            "rl",
            config_args(RL, model, "OUT", "--rollout.prompts", str(prompts)),
            "prompts.jsonl, line 2",
        ),
        "a truncated config.json": (
            "sft",
            sft_args(str(damaged_model), "OUT", good),
            "config.json is not valid JSON",
        ),
        "a reward that cannot be imported": (
            "rl",
            config_args(RL, model, "OUT", "--rollout.reward", "no_such_module:reward"),
            "'rollout.reward' = 'no_such_module:reward'",
        ),
    }
    for what, (command, args, named) in cases.items():
        parent = tmp_path / what.replace(" ", "-")
        out = parent / "runs" / "x"
        proc = run_cli(command, *(str(out) if a == "OUT" else a for a in args), check=False)
        assert named in one_error_line(proc), (what, proc.stderr)
        assert not parent.exists(), (what, sorted(parent.rglob("*")))


def test_a_failed_start_into_an_empty_directory_leaves_it_empty(tiny_model_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    bad = write_jsonl(tmp_path / "sft.jsonl", [GOOD, '{"completion": "x"}\n'])
    one_error_line(run_cli("sft", *sft_args(str(tiny_model_dir), str(out), bad), check=False))
    assert list(out.iterdir()) == []


def test_a_step_1_that_raises_leaves_no_directory_and_a_later_one_leaves_the_run(
    tiny_model_dir, tmp_path
):
    from fnt.loop import run
    from fnt.sources import sft_source
    from steps import sft_step

    config, _ = load_config(["--config", str(REPO / SFT)], Config)
    out = tmp_path / "runs" / "x"
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, name=str(tiny_model_dir)),
        output_dir=str(out),
        max_steps=2,
    )

    def failing_at(step: int):
        def step_fn(state, batch):
            if state.progress.step + 1 == step:
                raise RuntimeError(f"step {step} failed")
            return sft_step(state, batch)

        return step_fn

    with pytest.raises(RuntimeError, match="step 1 failed"):
        run(config, failing_at(1), sft_source)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(RuntimeError, match="step 2 failed"):
        run(config, failing_at(2), sft_source)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()] == [1]


def test_a_failed_resume_leaves_the_run_directory_byte_for_byte(
    tiny_model_dir, damaged_model, tmp_path
):
    data = write_jsonl(tmp_path / "data.jsonl", [GOOD] * 8)
    out = tmp_path / "run"
    args = sft_args(str(tiny_model_dir), str(out), data, "--max-steps", "2", "--ckpt.interval",
                    "1", "--batch-size", "2", "--micro-batch-size", "2")  # fmt: skip
    run_cli("sft", *args)
    # The run's lock file holds the last holder's host and pid; a failed attempt writes its own
    # while it holds the lock, and must put the old text back.
    (out / LOCK_FILE).write_text("host elsewhere pid 1\n")
    before = contents(out)
    assert "checkpoints/step_2/COMPLETE" in before and "data_cache" in before
    more = ("--max-steps", "4", "--resume", "latest")
    write_jsonl(data, [GOOD] * 3 + ['{"prompt": "no completion"}\n'] + [GOOD] * 4)
    attempts = {
        # The data file changed under the run: the resume tokenizes it again and meets line 4.
        "a bad data line": (args, "data.jsonl, line 4"),
        "a refused config change": ((*args, "--model.dtype", "bfloat16"), "model.dtype"),
        "a truncated config.json": (
            sft_args(str(damaged_model), str(out), data, "--max-steps", "2"),
            "config.json is not valid JSON",
        ),
    }
    for what, (attempt, named) in attempts.items():
        proc = run_cli("sft", *attempt, *more, check=False)
        assert named in one_error_line(proc), (what, proc.stderr)
        assert contents(out) == before, what
