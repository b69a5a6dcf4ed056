"""`fnt show-data`: the samples as the trainer sees them, trained tokens marked."""

from __future__ import annotations

import json

from fnt.apps.show_data import GREEN, RESET, marked_text, runs
from tests.e2e.helpers import config_args, run_cli

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "thanks"},
    ]
}


def show(tiny_model_dir, tmp_path, *extra):
    path = tmp_path / "chat.jsonl"
    pair = {"prompt": "count", "completion": "1 2 3"}
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(pair) + "\n")
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    sources = json.dumps([{"path": str(path)}])
    return run_cli("show-data", *args, "--data.kind", "sources", "--data.sources", sources, *extra)


def test_show_data_marks_the_trained_tokens_and_counts_tokens_and_roles(tiny_model_dir, tmp_path):
    proc = show(tiny_model_dir, tmp_path, "--n", "2")
    path = tmp_path / "chat.jsonl"
    assert proc.stdout.splitlines()[0] == (
        f"== {path}, line 1: 45 tokens (2 trained, 43 context), kept; messages: 1 system, "
        "1 user, 1 assistant (1 trailing turns left out)"
    )
    assert "<|im_start|>assistant\n[[4<|im_end|>]]" in proc.stdout
    assert "thanks" not in proc.stdout  # the untrained last turn is not in the sample
    assert "[[1 2 3<|im_end|>]]" in proc.stdout
    assert proc.stdout.count("== ") == 2
    assert not (tmp_path / "run").exists()  # it trains nothing and writes nothing


def test_show_data_colours_the_trained_tokens_when_asked(tiny_model_dir, tmp_path):
    proc = show(tiny_model_dir, tmp_path, "--n", "1", "--color", "always")
    assert f"{GREEN}4<|im_end|>{RESET}" in proc.stdout and "[[" not in proc.stdout


def test_show_data_on_synthetic_data_says_what_it_shows(tiny_model_dir, tmp_path):
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    proc = run_cli("show-data", *args, check=False)
    assert proc.returncode == 2 and "show-data shows data.sources" in proc.stderr


def test_runs_and_marked_text():
    assert list(runs([1, 2, 3, 4], [False, True, True, False])) == [
        ([1], False),
        ([2, 3], True),
        ([4], False),
    ]
    assert list(runs([], [])) == []
    assert marked_text([("a", False), ("b", True)], color=False) == "a[[b]]"


def test_show_data_gives_a_dropped_samples_length_and_the_limit(tiny_model_dir, tmp_path):
    """The issue: an over-long chat showed as `0 tokens (0 trained, 0 context)`."""
    path = tmp_path / "long.jsonl"
    long_chat = {"messages": [{"role": "user", "content": "x" * 300}, CHAT["messages"][2]]}
    path.write_text(json.dumps(long_chat) + "\n")
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    sources = json.dumps([{"path": str(path)}])
    proc = run_cli(
        "show-data", *args, "--data.kind", "sources", "--data.sources", sources, "--seq-len", "64"
    )
    header = proc.stdout.splitlines()[0]
    assert header.startswith(f"== {path}, line 1: ")
    assert ", over seq_len=64, dropped_overlong;" in header
    assert int(header.split(": ")[1].split()[0]) > 300  # its real length, not 0
