"""Validation during training (fnt.evaluation): packing and rank shares, the loss equals each
held-out sample scored alone, greedy rewards, the rows' keys, and that validating never changes
training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt import fold, init_state, rl_source, sft_source
from fnt.config import (
    Config,
    DataConfig,
    DataSourceConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    ValConfig,
)
from fnt.data import load_corpus
from fnt.distributed.runtime import setup_trainer
from fnt.evaluation import Evaluation, is_due
from fnt.evaluation.held_out import loss_metrics, pack_in_order, rank_rows
from fnt.model.tokenizer import stop_token_ids
from fnt.obs.metrics import to_floats
from fnt.rollout.prompts import load_prompts
from fnt.rollout.rewards import ascii_letters
from fnt.rollout.sampling import generate
from steps import rl_step, sft_step

SEQ_LEN = 48
REPO = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, SEQ_LEN), max_size=30),
    dp_size=st.integers(1, 4),
    micro_batch_size=st.integers(1, 3),
)
def test_rows_hold_every_kept_sample_once_in_order_and_ranks_get_equal_whole_passes(
    lengths, dp_size, micro_batch_size
):
    rows = pack_in_order(lengths, SEQ_LEN)
    assert [s for row in rows for s in row] == [i for i, n in enumerate(lengths) if n]
    assert all(row and sum(lengths[s] for s in row) <= SEQ_LEN for row in rows)
    # Greedy: the first sample of each next row would not have fitted into the row before it.
    for row, after in zip(rows, rows[1:]):
        assert sum(lengths[s] for s in row) + lengths[after[0]] > SEQ_LEN
    shares = [rank_rows(rows, r, dp_size, micro_batch_size) for r in range(dp_size)]
    assert len({len(share) for share in shares}) == 1
    assert len(shares[0]) % micro_batch_size == 0
    assert [row for share in shares for row in share if row] == list(rows)


def test_due_steps_and_the_loss_metrics():
    assert [s for s in range(0, 10) if is_due(s, 3)] == [3, 6, 9]
    assert not any(is_due(s, 0) for s in range(5))
    assert loss_metrics(6.0, 3.0) == {"loss": 2.0, "perplexity": math.exp(2.0), "num_tokens": 3.0}
    assert loss_metrics(1e6, 1.0)["perplexity"] == math.inf


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def samples(count: int, offset: int) -> list[dict]:
    return [
        {"prompt": f"say {i} " + "x" * (i % 7), "completion": "y" * (1 + i % 5)}
        for i in range(offset, offset + count)
    ]


def sft_config(model_dir, tmp_path, **val) -> Config:
    train = write_jsonl(tmp_path / "train.jsonl", samples(20, 0))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", samples(7, 50))
    return Config(
        model=ModelConfig(name=str(model_dir)),
        output_dir=str(tmp_path / "run"),
        seq_len=SEQ_LEN,
        batch_size=4,
        micro_batch_size=2,
        max_steps=3,
        data=DataConfig(kind="sources", sources=(DataSourceConfig(path=str(train)),)),
        val=ValConfig(sources=(DataSourceConfig(path=str(held_out)),), **val),
    )


def train_rows(config, step_fn, source, *, validate: bool):
    """The step metrics and val metrics of config.max_steps steps, and the final state."""
    state = init_state(config, setup_trainer(config))
    validation = Evaluation(state) if validate else None
    rows = []
    for state, metrics in fold(state, source, step_fn, config.max_steps):
        rows.append((to_floats(metrics), validation.row_metrics(state) if validate else {}))
    return rows, state


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_the_val_loss_is_every_held_out_sample_scored_alone(tiny_model_dir, tmp_path):
    config = sft_config(tiny_model_dir, tmp_path, eval_on_start=True)
    state = init_state(config, setup_trainer(config))
    model = state.handles.model
    assert model.training
    start = Evaluation(state).row_metrics(state)
    assert model.training and all(p.grad is None for p in model.parameters())

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    corpus = load_corpus(config.val.sources, tokenizer, seq_len=SEQ_LEN, overlong="truncate")
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(corpus.num_samples):
            ids, targets = corpus.tokens(i)
            logp = torch.log_softmax(reference(input_ids=ids[None]).logits[0, :-1].double(), -1)
            token_logp = logp.gather(-1, ids[1:, None]).squeeze(-1)
            loss_sum -= float(token_logp[targets[1:]].sum())
            count += int(targets[1:].sum())
    assert start["val/start/num_tokens"] == count
    assert start["val/start/loss"] == pytest.approx(loss_sum / count, rel=1e-5)
    assert set(start) == {
        "val/start/loss",
        "val/start/perplexity",
        "val/start/num_tokens",
        "time/val",
    }


def test_validating_changes_no_step_and_fills_the_due_rows(tiny_model_dir, tmp_path):
    config = sft_config(tiny_model_dir, tmp_path, interval=2, eval_on_start=True)
    plain, plain_state = train_rows(config, sft_step, sft_source, validate=False)
    validated, state = train_rows(config, sft_step, sft_source, validate=True)
    assert [untimed(m) for m, _ in validated] == [untimed(m) for m, _ in plain]
    assert state.progress == plain_state.progress
    for a, b in zip(state.handles.model.parameters(), plain_state.handles.model.parameters()):
        assert torch.equal(a, b)
    val_keys = [sorted(k for k in v if k != "time/val") for _, v in validated]
    assert val_keys == [
        ["val/start/loss", "val/start/num_tokens", "val/start/perplexity"],
        ["val/loss", "val/num_tokens", "val/perplexity"],
        [],
    ]
    assert [v["time/val"] > 0 for _, v in validated] == [True, True, False]


def test_rl_validation_scores_greedy_answers_of_the_policy(tiny_model_dir, tmp_path):
    prompts = write_jsonl(
        tmp_path / "val_prompts.jsonl", [{"prompt": f"count {i}"} for i in range(5)]
    )
    config = RLConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        output_dir=str(tmp_path / "run"),
        seq_len=64,
        batch_size=4,
        micro_batch_size=2,
        max_steps=2,
        rollout=RolloutConfig(
            prompts=str(REPO / "examples" / "debug" / "prompts.jsonl"),
            reward="ascii_letters",
            prompts_per_step=2,
            group_size=2,
            max_new_tokens=6,
        ),
        val=ValConfig(prompts=str(prompts), interval=2, eval_on_start=True),
    )
    plain, _ = train_rows(config, rl_step, rl_source, validate=False)
    validated, _ = train_rows(config, rl_step, rl_source, validate=True)
    exact = ("loss/mean", "reward/mean", "optim/grad_norm")
    assert [[m[k] for k in exact] for m, _ in validated] == [
        [m[k] for k in exact] for m, _ in plain
    ]
    first, second = (v for _, v in validated)
    assert set(first) == {"val/start/reward/mean", "time/val"}
    assert set(second) == {"val/reward/mean", "time/val"}

    # The start state is the model as saved: answer each prompt greedily and score it here.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rewards = []
    for prompt in load_prompts(prompts, tokenizer):
        # One prompt at a time, with the stop tokens of the model directory.
        ((answer,),) = generate(
            model,
            [prompt.token_ids],
            num_samples=1,
            max_new_tokens=6,
            stop_token_ids=stop_token_ids(tokenizer, tiny_model_dir),
            greedy=True,
        )
        # Read as a training turn is (fnt.rollout.environments.parsers.read_turn): special
        # tokens kept, the stop token left off.
        ids = answer.token_ids[:-1] if answer.stopped else answer.token_ids
        rewards.append(ascii_letters(tokenizer.decode(list(ids), skip_special_tokens=False), {}))
    assert first["val/start/reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)


def test_a_held_out_answer_is_read_as_a_training_turn_is(tiny_model_dir):
    """The held-out reward scores the text a training reward would: the stop token left off,
    other special tokens kept (a `cb<eos>a` answer is not "cba"), the content of the model's
    family's reading (fnt.rollout.environments.parsers.read_turn)."""
    import types

    from fnt.evaluation.held_out import held_out_message
    from fnt.rollout.prompts import Prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = (*encode("cb"), eos, *encode("a"), eos)
    data = types.SimpleNamespace(tokenizer=tokenizer, environment=None)
    prompt = Prompt(record={}, token_ids=tuple(encode("reverse abc")), line=1)
    message = held_out_message(prompt, ids, data, RLConfig(), {eos})
    assert message["content"] == "cb" + tokenizer.eos_token + "a"
    assert held_out_message(prompt, ids[:-1], data, RLConfig(), {eos})["content"] == (
        "cb" + tokenizer.eos_token + "a"
    )
