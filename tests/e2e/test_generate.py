"""`fnt generate`: a checkpoint's answers (plain and LoRA) without exporting, the same as the
evaluation path's greedy answers from the exported model, and reproducible sampled answers.
Its bad input is in tests/e2e/test_bad_input.py."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt.evaluation.held_out import greedy_answers
from fnt.model.tokenizer import stop_token_ids
from fnt.rollout.prompts import load_prompts
from tests.e2e.helpers import config_args, run_cli

PROMPTS = "examples/debug/prompts.jsonl"


def generated(*args: str) -> list[dict]:
    """The answers `fnt generate ARGS --json` prints."""
    proc = run_cli("generate", *args, "--json")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def evaluation_answers(model_dir, max_new_tokens: int) -> list[str]:
    """The greedy answers validation gives (fnt.evaluation.held_out.greedy_answers) with the
    model and tokenizer of a Hugging Face directory loaded by transformers itself."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = load_prompts(PROMPTS, tokenizer)
    stops = stop_token_ids(tokenizer, str(model_dir))
    answers = greedy_answers(model, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops)
    return [tokenizer.decode(list(ids), skip_special_tokens=True) for ids in answers]


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoint_answers_as_its_export_does_in_validation(tiny_model_dir, tmp_path, lora):
    extra = ("--model.lora.rank", "4", "--optim.lr", "1e-2") if lora else ()
    out = tmp_path / "run"
    run_cli("sft", *config_args("examples/debug/sft.toml", tiny_model_dir, out, "--max-steps",
                                "2", *extra))  # fmt: skip
    checkpoint, exported = out / "checkpoints" / "step_2", tmp_path / "hf"
    run_cli("export", "--checkpoint", str(checkpoint), "--out", str(exported), "--merge")
    limit = ("--max-new-tokens", "6")
    answers = generated("--checkpoint", str(checkpoint), "--prompts", PROMPTS, *limit)
    assert [a["line"] for a in answers] == list(range(1, 33))
    assert answers[0]["prompt"] == [{"role": "user", "content": "continue: 12 13 14"}]
    texts = [a["answer"] for a in answers]
    assert texts == evaluation_answers(exported, 6)
    assert texts == [a["answer"] for a in generated("--checkpoint", str(exported), "--prompts",
                                                    PROMPTS, *limit)]  # fmt: skip
    # The training changed the answers: they are the checkpoint's, not the base model's.
    assert texts != evaluation_answers(tiny_model_dir, 6)


def test_sampled_answers_are_n_per_prompt_and_follow_the_seed(tiny_model_dir):
    args = ("--checkpoint", str(tiny_model_dir), "--prompt", "hi", "--prompt", "count to 3")
    sampled = (*args, "--temperature", "1", "--n", "3", "--max-new-tokens", "5")
    first = generated(*sampled)
    assert [(a["line"], a["sample"]) for a in first] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1),
                                                         (2, 2)]  # fmt: skip
    assert first == generated(*sampled)
    assert first != generated(*sampled, "--seed", "1")
    assert len({a["answer"] for a in first}) > 1
    (greedy,) = generated(*args[:4], "--max-new-tokens", "5")
    assert greedy["prompt"] == [{"role": "user", "content": "hi"}] and greedy["tokens"] <= 5


def test_a_prompt_longer_than_the_context_is_refused_or_cut_from_the_left(tiny_model_dir, tmp_path):
    # The tiny model has 1024 positions and one token per byte (issue 45.5).
    long = "x" * 1100
    proc = run_cli("generate", "--checkpoint", str(tiny_model_dir), "--prompt", "hi",
                   "--prompt", long, check=False)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --prompt number 2: the prompt is 11"), lines[0]
    assert "more than the model's 1024 (max_position_embeddings)" in lines[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    args = ("--checkpoint", str(tiny_model_dir), "--prompts", str(prompts), "--max-new-tokens", "4")
    proc = run_cli("generate", *args, check=False)
    assert proc.returncode == 2 and f"error: --prompts '{prompts}', line 2: the" in proc.stderr
    # Room for the answer counts: a prompt of about 900 tokens fits 4 new ones, not 200.
    fits = ("--checkpoint", str(tiny_model_dir), "--prompt", "x" * 900, "--max-new-tokens")
    assert run_cli("generate", *fits, "4").returncode == 0
    assert (
        "error: --prompt number 1: the prompt is 9"
        in run_cli("generate", *fits, "200", check=False).stderr
    )
    proc = run_cli("generate", *args, "--truncate-prompts", "--json")
    (note,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert note.startswith(f"note: --prompts '{prompts}', line 2: the prompt is 11")
    assert "(--truncate-prompts)" in note and "in the model's 1024 positions" in note
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [a["line"] for a in answers] == [1, 2] and all(a["tokens"] <= 4 for a in answers)
