"""ContinuousBatch: requests that join a batch half-way sample what `generate` samples for each
alone (same generator), carry caches that continue them, and leave the batch as they stop."""

from __future__ import annotations

import pytest
import torch

from fnt.rollout import generate, render_prompt, sampling_seed
from fnt.rollout.continuous import ContinuousBatch, Request

EOS = 256  # <|im_end|> of the tiny byte-level tokenizer


def prompt(tokenizer, text: str) -> list[int]:
    return render_prompt([{"role": "user", "content": text}], tokenizer)


def seeded(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(sampling_seed(4, 2, i))


def alone(model, context, n, limit, i, cache=None):
    (completions,) = generate(
        model,
        [context],
        num_samples=n,
        max_new_tokens=limit,
        stop_token_ids={EOS},
        generators=[seeded(i)],
        caches=None if cache is None else [cache],
    )
    return completions


def drain(batch) -> dict:
    """Step until the batch is empty; the completions by key."""
    done = {}
    while batch.busy:
        done.update(batch.step())
    return done


def close(a, b) -> None:
    assert a.token_ids == b.token_ids and a.stopped == b.stopped
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
    )


def test_requests_that_join_half_way_sample_what_each_samples_alone(eval_model, tokenizer):
    contexts = [prompt(tokenizer, t) for t in ("olleh", "kiwi", "xyz abc", "ab")]
    batch = ContinuousBatch(eval_model, stop_token_ids={EOS}, keep_caches=True)
    batch.add(Request(((0, 0), (0, 1), (0, 2)), tuple(contexts[0]), 12, seeded(0)))
    done: dict = {}
    steps = 0
    # The other requests join after 2, 3 and 5 steps: into a batch of rows half-way.
    joins = {2: 1, 3: 2, 5: 3}
    while batch.busy or len(joins):
        steps += 1
        if steps in joins:
            i = joins.pop(steps)
            assert batch.rows  # it joins rows that are half-way
            batch.add(Request(((i, 0), (i, 1)), tuple(contexts[i]), 9, seeded(i)))
        done.update(batch.step())
    assert len(done) == 3 + 2 * 3
    for i, context in enumerate(contexts):
        n, limit = (3, 12) if i == 0 else (2, 9)
        for k, expected in enumerate(alone(eval_model, context, n, limit, i)):
            close(done[(i, k)], expected)
    assert {c.stopped for c in done.values()} == {True, False}  # both endings were exercised
    # Every completion's cache continues it: a second turn from the cache samples what a second
    # turn from the whole context samples.
    reply = prompt(tokenizer, "again")
    for i, k in [(0, 1), (2, 0), (3, 1)]:
        first = done[(i, k)]
        context = (*contexts[i], *first.token_ids, *reply)
        assert first.cache.token_ids == tuple(contexts[i]) + first.token_ids[:-1]
        batch.add(Request(("next",), context, 6, seeded(10 + i), cache=first.cache))
        (expected,) = alone(eval_model, list(context), 1, 6, 10 + i)
        close(drain(batch)["next"], expected)


def test_a_finished_batch_is_empty_and_steps_return_nothing(eval_model, tokenizer):
    batch = ContinuousBatch(eval_model, stop_token_ids={EOS})
    assert not batch.busy and batch.step() == []
    batch.add(Request(("a",), tuple(prompt(tokenizer, "kiwi")), 2, seeded(0)))
    done = drain(batch)
    assert list(done) == ["a"] and done["a"].cache is None
    assert batch.kv_cache is None and batch.rows == []


def test_malformed_requests_are_refused(eval_model, tokenizer):
    batch = ContinuousBatch(eval_model, stop_token_ids={EOS}, keep_caches=True)
    ids = tuple(prompt(tokenizer, "kiwi"))
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        batch.add(Request(("a",), ids, 0))
    with pytest.raises(ValueError, match="stop_token_ids is empty"):
        ContinuousBatch(eval_model, stop_token_ids=set())
    batch.add(Request(("a",), ids, 3))
    done = drain(batch)["a"]
    with pytest.raises(ValueError, match="not of a proper prefix"):
        batch.add(Request(("b",), done.cache.token_ids, 3, cache=done.cache))
