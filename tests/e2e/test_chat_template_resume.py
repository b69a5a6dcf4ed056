"""A multi-turn SFT run under Qwen3's real chat template (data.chat_template) trains and resumes
exactly. Qwen3 strips earlier turns' reasoning, so each chat gives one sample per turn."""

from __future__ import annotations

import json

import pytest

from tests.chat_fixtures import load_fixture
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
)

N, K = 4, 2
EXACT_KEYS = ("loss/mean", "optim/grad_norm", "progress/num_samples", "progress/num_tokens")


def write_chats(path, count: int) -> None:
    with path.open("w") as fh:
        for i in range(count):
            messages = [
                {"role": "system", "content": "Answer in digits."},
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"<think>\n{i} and one\n</think>\n\n{i + 1}"},
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": str(2 * (i + 1))},
            ]
            fh.write(json.dumps({"messages": messages}) + "\n")


@pytest.mark.numerics
def test_a_multi_turn_qwen3_template_run_trains_and_resumes_exactly(tiny_model_dir, tmp_path):
    template = tmp_path / "qwen3.jinja"
    template.write_text(load_fixture("qwen3")["chat_template"])
    chats = tmp_path / "chats.jsonl"
    write_chats(chats, 12)

    def args(out, *extra):
        return config_args(
            "examples/debug/sft.toml",
            tiny_model_dir,
            out,
            "--max-steps",
            str(N),
            "--batch-size",
            "4",
            "--seq-len",
            "256",
            "--data.kind",
            "sources",
            "--data.sources",
            json.dumps([{"path": str(chats)}]),
            "--data.chat-template",
            str(template),
            *extra,
        )

    full = tmp_path / "full"
    run_cli("sft", *args(full, "--ckpt.interval", str(K)))
    rows = read_metrics(full)
    assert rows[-1]["loss/mean"] < rows[0]["loss/mean"]  # it trains
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    run_cli("sft", *args(resumed, "--resume", "latest"))
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)
