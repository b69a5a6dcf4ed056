"""A micro-batch with a NaN loss is left out and counted; training goes on without NaN weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fnt.data.synthetic import synthetic_rows
from steps.sft import sft_step
from tests.steps.test_sft import batch_of, make_state


def test_nan_micro_batch_is_skipped_in_one_process(tiny_model_dir):
    state = make_state(tiny_model_dir)
    model = state.handles.model
    calls = {"n": 0}

    def poison_second_call(module, inputs, output):
        calls["n"] += 1
        return output + float("nan") if calls["n"] == 2 else output

    model.lm_head.register_forward_hook(poison_second_call)
    before = [p.detach().clone() for p in model.parameters()]
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    state, metrics = sft_step(state, batch_of(rows, micro_batch_size=1))
    assert float(metrics["loss/nan_count"]) == 1.0
    assert math.isfinite(float(metrics["loss/mean"]))
    assert float(metrics["optim/skipped"]) == 0.0
    for p, p0 in zip(model.parameters(), before):
        assert torch.isfinite(p).all()
    assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))


def nan_job(fixture, out):
    return {"call": "tests.steps.nan_loop:main", "args": [str(fixture("tiny_model_dir")), str(out)]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=nan_job)
def test_nan_or_no_loss_on_one_rank_neither_hangs_nor_poisons_weights(two_rank_runs):
    out = two_rank_runs(nan_job)
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["weights_finite"]
        step1, step2 = r["rows"]
        assert step1["loss/nan_count"] == 1.0 and step2["loss/nan_count"] == 0.0
        assert step1["optim/skipped"] == 0.0 and math.isfinite(step1["loss/mean"])
        # Two micro-batches per rank and step: rank 1 runs its last one at step 2 although it
        # has no loss tokens, because rank 0's has (a mismatch would hang FSDP2).
        assert r["forwards"] == 4


def test_a_non_finite_gradient_norm_skips_the_update_on_the_device(tiny_model_dir):
    """torch's fused AdamW is given the decision (found_inf) and leaves weights, moments and
    step counts as they were, without the host reading the norm; the next step trains."""
    state = make_state(tiny_model_dir)
    model, optimizer = state.handles.model, state.handles.optimizer
    assert all(group["fused"] for group in optimizer.param_groups)
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    batch = batch_of(rows, micro_batch_size=2)
    state, _ = sft_step(state, batch)  # the optimizer's state exists from here
    before = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    steps = [optimizer.state[p]["step"].clone() for p in model.parameters()]
    weight = next(model.parameters())
    handle = weight.register_hook(lambda grad: grad * float("inf"))
    state, metrics = sft_step(state, batch)
    handle.remove()
    assert float(metrics["optim/skipped"]) == 1.0
    assert not math.isfinite(float(metrics["optim/grad_norm"]))
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
    for p, m0, s0 in zip(model.parameters(), moments, steps):
        assert torch.equal(optimizer.state[p]["exp_avg"], m0)
        assert torch.equal(optimizer.state[p]["step"], s0)
    state, metrics = sft_step(state, batch)
    assert float(metrics["optim/skipped"]) == 0.0
    assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
