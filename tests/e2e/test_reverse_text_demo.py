"""The reverse-text demo end to end (slow: about 5 minutes on 2 CPU cores).

Runs `make demo`'s script and checks what issue 4 promises: SFT leaves held-out similarity in the
0.5-0.7 band that gives RL room, and RL then raises it by at least 0.1 on the same prompts with
the same greedy decoding; and what issue 34 promises: DPO from the same SFT result raises it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO


@pytest.mark.slow
def test_demo_sft_then_rl_raises_heldout_similarity(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples/reverse_text/demo.py"), "--runs", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert set(result) == {"sft_before", "sft_after", "dpo_after", "rl_after"}
    # SFT learned (the base model scores about 0) and left RL room.
    assert result["sft_before"] + 0.2 <= result["sft_after"] <= 0.85
    assert result["rl_after"] >= result["sft_after"] + 0.1
    # DPO on pairs of a correct and a corrupted reversal raises it too (0.62 -> 0.66 measured).
    assert result["dpo_after"] > result["sft_after"]
    # Every RL step logged one row.
    rows = (tmp_path / "reverse-rl" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(row)["step"] for row in rows]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 1


def test_each_held_out_line_says_which_model_it_scored(tiny_model_dir, tmp_path, capfd):
    """The demo's held-out evals are labelled: a line naming the stage's model, then eval.py's
    JSON, which names the directory it scored (issue 45: bare {"similarity": 0.0, "n": 200}
    lines did not say which model they were)."""
    from examples.reverse_text.demo import evaluate
    from examples.reverse_text.make_data import prompt_record

    (tmp_path / "heldout.jsonl").write_text(
        "".join(json.dumps(prompt_record(text)) + "\n" for text in ("abc", "hello"))
    )
    similarity = evaluate(tiny_model_dir, tmp_path, "the SFT model")
    lines = capfd.readouterr().out.strip().splitlines()
    assert lines[-2] == f"held-out similarity of the SFT model ({tiny_model_dir}):"
    scored = json.loads(lines[-1])
    assert scored == {"model": str(tiny_model_dir), "similarity": similarity, "n": 2}
