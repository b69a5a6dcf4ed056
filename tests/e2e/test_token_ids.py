"""Token ids outside the model's vocabulary never reach the model: from a data source (a
tokenizer larger than the model's embedding), from a cache entry, from a preference pair and
from an external rollout file, the run stops with exit status 2 and one line naming where the
id came from, the id and the vocabulary size, before the step that would have used it (no row
for it)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fnt.data.cache import read_entry, write_entry_
from tests.e2e.helpers import config_args, read_metrics, run_cli

VOCAB = 260  # the tiny model's embedding rows
OUTSIDE = f"is outside the model's vocabulary ({VOCAB} rows in its input embedding, ids 0..259)"


def write_records(path: Path, count: int, special: dict[int, str] = {}) -> Path:
    """Prompt/completion pairs, line i + 1 holding record i; `special` replaces a completion."""
    path.write_text(
        "".join(
            json.dumps({"prompt": f"count to {i}", "completion": special.get(i, f"{i} {i + 1}")})
            + "\n"
            for i in range(count)
        )
    )
    return path


def sft_args(model_dir, out: Path, data: Path, *extra: str) -> tuple[str, ...]:
    sources = ("--data.kind", "sources", "--data.sources", json.dumps([{"path": str(data)}]))
    more = ("--data.shuffle", "false", "--max-steps", "6", *extra)
    return config_args("examples/debug/sft.toml", model_dir, out, *sources, *more)


def stopped_before(proc, out: Path) -> int:
    """The update the error line says was not trained; asserts that the run exited 2 with that
    one line and wrote the rows before it, not its own."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    update = int(re.search(r"nothing of update (\d+) was trained$", line).group(1))
    assert update > 1, line  # the bad sample is not in the first step: earlier steps trained
    assert [r["step"] for r in read_metrics(out)] == list(range(1, update))
    return update


def test_an_id_the_model_lacks_from_a_jsonl_source_is_located(tiny_model_dir, tmp_path):
    """The tokenizer has a token more than the model has embedding rows; a record uses it."""
    model = model_with_a_token_more(tiny_model_dir, tmp_path)
    data = write_records(tmp_path / "train.jsonl", 60, {40: "41 <extra> 42"})
    out = tmp_path / "run"
    proc = run_cli("sft", *sft_args(model, out, data), check=False)
    stopped_before(proc, out)
    assert re.fullmatch(
        rf"error: {re.escape(str(data))}, line 41, token \d+ of its sample: token id {VOCAB} "
        rf"{re.escape(OUTSIDE)}; nothing of update \d+ was trained",
        proc.stderr.strip(),
    ), proc.stderr


def test_an_id_the_model_lacks_from_a_cache_entry_is_located(tiny_model_dir, tmp_path):
    """A cache entry that passes its checksum but holds an id the model lacks (as a writer
    with another tokenizer might leave one) is named with the record it holds."""
    data = write_records(tmp_path / "train.jsonl", 60)
    cache = tmp_path / "cache"
    run_cli(
        "sft", *sft_args(tiny_model_dir, tmp_path / "first", data, "--data.cache-dir", str(cache))
    )
    (entry,) = cache.iterdir()
    samples = read_entry(entry)
    first = sum(samples.lengths[: samples.records.index(40)])  # record 40's sample
    samples.ids[first + 3] = 999
    write_entry_(samples, entry)
    out = tmp_path / "run"
    proc = run_cli(
        "sft", *sft_args(tiny_model_dir, out, data, "--data.cache-dir", str(cache)), check=False
    )
    update = stopped_before(proc, out)
    assert proc.stderr.strip() == (
        f"error: {data}, line 41, token 3 of its sample (read from the cache entry {entry}): "
        f"token id 999 {OUTSIDE}; nothing of update {update} was trained"
    )


def test_an_id_the_model_lacks_from_an_external_rollout_file_is_located(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    good = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "advantage": 1.0}
    # The longer sample is packed first (fnt.rollout.pack): its bad id is found by its line.
    bad = {"prompt_ids": [1, 2], "completion_ids": [4, 5, 6, 300, 7, 8], "advantage": -1.0}
    files = {1: [good, good], 2: [good, None, bad]}  # None: a blank line, which is no sample

    def orchestrate():
        while not (out / "weights" / "step_0" / "COMPLETE").is_file():
            threading.Event().wait(0.05)
        for step, samples in files.items():
            directory = out / "rollouts" / f"step_{step}"
            directory.mkdir(parents=True)
            lines = [json.dumps(s) if s else "" for s in samples]
            (directory / "samples.jsonl").write_text("\n".join(lines) + "\n")
            (directory / "COMPLETE").write_text("")

    orchestrator = threading.Thread(target=orchestrate, daemon=True)
    orchestrator.start()
    args = config_args(
        "examples/debug/rl.toml",
        tiny_model_dir,
        out,
        *("--max-steps", "3", "--rollout.engine", "external", "--rollout.timeout-s", "60"),
        *("--batch-size", "2", "--micro-batch-size", "1"),
    )
    proc = run_cli("rl", *args, check=False)
    orchestrator.join(10)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"error: {out / 'rollouts' / 'step_2' / 'samples.jsonl'}, line 3, 'completion_ids'[3]: "
        f"token id 300 {OUTSIDE}; nothing of update 2 was trained"
    )
    assert [r["step"] for r in read_metrics(out)] == [1]


def model_with_a_token_more(tiny_model_dir, out: Path) -> Path:
    """The tiny model with one token more in its tokenizer than rows in its embedding."""
    model = out / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(model)
    return model


def test_an_id_the_model_lacks_in_a_preference_pair_is_located_with_its_side(
    tiny_model_dir, tmp_path
):
    model = model_with_a_token_more(tiny_model_dir, tmp_path)
    pairs = [
        {"prompt": f"count to {n}", "chosen": " ".join(map(str, range(1, n + 1))), "rejected": "9"}
        for n in range(2, 42)
    ]
    pairs[30]["rejected"] = "9 <extra> 8"
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    out = tmp_path / "run"
    args = config_args(
        "examples/debug/dpo.toml",
        model,
        out,
        *("--data.sources", json.dumps([{"path": str(data)}]), "--data.shuffle", "false"),
    )
    proc = run_cli("dpo", *args, check=False)
    stopped_before(proc, out)
    assert re.fullmatch(
        rf"error: {re.escape(str(data))}, line 31, token \d+ of its rejected side: token id "
        rf"{VOCAB} {re.escape(OUTSIDE)}; nothing of update \d+ was trained",
        proc.stderr.strip(),
    ), proc.stderr


def two_rank_job(fixture, out):
    out.mkdir(parents=True)
    model = model_with_a_token_more(fixture("tiny_model_dir"), out)
    data = write_records(out / "train.jsonl", 60, {40: "41 <extra> 42"})
    args = ["sft", *sft_args(model, out / "run", data)]
    return {"call": f"{__name__}:main_without_the_exit_delay", "args": [args]}


def main_without_the_exit_delay(argv: list[str]) -> None:
    """`fnt` with argv, but a rank other than 0 exits on bad input at once: without torchrun's
    error file it does not wait for rank 0's line (fnt.cli.exit_with), which here another job
    of the launch would wait for."""
    import os

    from fnt.__main__ import main

    error_file = os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    try:
        main(argv)
    finally:
        if error_file is not None:
            os.environ["TORCHELASTIC_ERROR_FILE"] = error_file


@pytest.mark.two_ranks(job=two_rank_job)
def test_at_two_ranks_the_rank_without_the_bad_id_stops_too(two_rank_runs):
    """The bad sample is in one rank's rows; both ranks stop before the step with the same
    error, which rank 0 prints, instead of one waiting in the step for the other."""
    out = two_rank_runs(two_rank_job)
    assert [(out / f"rank{r}.exit").read_text() for r in (0, 1)] == ["2\n", "2\n"]
    (line,) = [x for x in (out / "rank0.log").read_text().splitlines() if x.startswith("error:")]
    assert f"{out / 'train.jsonl'}, line 41, token " in line and f"token id {VOCAB} " in line
    update = int(re.search(r"nothing of update (\d+) was trained$", line).group(1))
    assert update > 1 and [r["step"] for r in read_metrics(out / "run")] == list(range(1, update))
    assert "error:" not in (out / "rank1.log").read_text()
