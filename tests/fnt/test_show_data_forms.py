"""`fnt show-data` says which form each record was read as (issue 45.7): messages, ShareGPT
conversations with each speaker's role, prompt/completion, text; and marks empty turns."""

from __future__ import annotations

import json

from fnt.apps.show_data import record_summary
from fnt.data.chat import read_record
from tests.e2e.helpers import config_args, run_cli

RECORDS = [
    {"text": "Once upon a time."},
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    },
    {"prompt": "count", "completion": "1 2 3"},
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": ""},
        ]
    },
]


def test_record_summary_names_the_form_and_each_speakers_role():
    summaries = [record_summary(read_record(r), read_record(r).messages) for r in RECORDS]
    assert summaries == [
        "text: every token trained",
        "conversations (from/value): 1 system, 1 human as user, 1 gpt as assistant",
        "prompt/completion: 1 user, 1 assistant",
        "messages: 1 user, 1 assistant (content parts joined)",
    ]
    # Only the messages as trained are counted; a record left out has no form to show.
    read = read_record(RECORDS[1])
    assert record_summary(read, read.messages[:2]) == (
        "conversations (from/value): 1 system, 1 human as user"
    )
    assert record_summary(None, []) == "messages: "


def test_show_data_says_how_each_record_was_read(tiny_model_dir, tmp_path):
    path = tmp_path / "forms.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "run")
    sources = json.dumps([{"path": str(path)}])
    proc = run_cli(
        "show-data", *args, "--data.kind", "sources", "--data.sources", sources, "--n", "4"
    )
    headers = [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert [h.split("; ", 1)[1] for h in headers] == [
        "text: every token trained",
        "conversations (from/value): 1 system, 1 human as user, 1 gpt as assistant",
        "prompt/completion: 1 user, 1 assistant",
        "messages: 1 user, 1 assistant (content parts joined) (empty assistant turn: messages[1])",
    ]
    assert headers[0].startswith(f"== {path}, line 1: 18 tokens (17 trained, 1 context), kept")
    assert "[[nce upon a time.<|im_end|>]]" in proc.stdout  # all but the first token
    assert "user\na\nb<|im_end|>" in proc.stdout
    assert not (tmp_path / "run").exists()
