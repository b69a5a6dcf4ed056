"""The reference-model KL: a frozen second policy from loss.ref_model, compared against a
recomputation with a separately loaded reference model, and 2 ranks (FSDP2) against 1, with
the zero-advantage skip decided alike on both ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.config import LoraConfig, RLLossConfig
from steps.rl import reference_logprobs, rl_gradients_, rl_metrics, rl_step
from tests.steps.test_rl_step import (
    ADVANTAGES,
    ROWS,
    TEMPERATURES,
    make_state,
    own_logprobs,
    random_rows,
    rl_batch,
)

REF_KL_TAU = 0.5


@pytest.fixture(scope="module")
def reference_dir(tiny_reference_dir) -> Path:
    """The tiny model's architecture with other random weights (seed 1)."""
    return tiny_reference_dir


def off_policy_inference(model, rows, seed: int = 7) -> torch.Tensor:
    noise = 0.3 * torch.randn(rows.input_ids.shape, generator=torch.Generator().manual_seed(seed))
    return own_logprobs(model, rows) + noise


def recomputed(policy_dir, reference_dir, rows, inference, config: RLLossConfig):
    """Loss, parameter gradients and ref KL by the formulas, in float64, with models loaded
    here: the policy (to differentiate) and the reference, run on each row alone."""
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    loss, k3, count = torch.zeros((), dtype=torch.float64), 0.0, 0
    for b in range(ROWS):
        ids = rows.input_ids[b : b + 1]
        temp = TEMPERATURES[b]
        logp_all = torch.log_softmax(policy(ids).logits[0].double() / temp, -1)
        with torch.no_grad():
            ref_all = torch.log_softmax(reference(ids).logits[0].double() / temp, -1)
        for t in range(1, ids.shape[1]):
            if not rows.loss_mask[b, t]:
                continue
            token = ids[0, t]
            logp, ref, q = (
                logp_all[t - 1, token],
                float(ref_all[t - 1, token]),
                float(inference[b, t]),
            )
            a = ADVANTAGES[b]
            dp = math.exp(float(logp.detach())) - math.exp(q)
            masked = (a > 0 and dp > config.dppo_mask_high) or (
                a < 0 and dp < -config.dppo_mask_low
            )
            # The KL term carries the importance weight r = pi / q of a kept token.
            weight = 1.0 if masked else math.exp(float(logp.detach()) - q)
            kl = config.ref_kl_tau * weight * 0.5 * (logp - ref) ** 2
            term = config.kl_tau * (logp - q) ** 2 + kl
            if not masked:
                term = term - a * torch.exp(logp - q)
            loss = loss + term
            d = ref - float(logp.detach())
            k3 += math.exp(d) - d - 1
            count += 1
    (loss / count).backward()
    grads = {name: p.grad for name, p in policy.named_parameters()}
    return float(loss.detach() / count), grads, k3 / count


def test_reference_kl_matches_a_recomputation_with_a_separate_reference_model(
    tiny_model_dir, reference_dir
):
    config = RLLossConfig(ref_kl_tau=REF_KL_TAU, ref_model=str(reference_dir))
    state = make_state(tiny_model_dir, loss=config)
    model, runtime, ref_model = state.handles.model, state.handles.runtime, state.handles.ref_model
    assert ref_model is not None
    assert not any(p.requires_grad for p in ref_model.parameters())
    optimized = {id(p) for group in state.handles.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in ref_model.parameters()}

    rows = random_rows(11)
    inference = off_policy_inference(model, rows)
    totals = rl_gradients_(model, rl_batch(rows, inference), runtime, config, 16, ref_model)
    want_loss, want_grads, want_kl = recomputed(
        tiny_model_dir, reference_dir, rows, inference, config
    )
    metrics = {**totals.metrics(), **rl_metrics(totals)}
    assert float(metrics["loss/mean"]) == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert float(metrics["ref_kl/mean"]) == pytest.approx(want_kl, rel=1e-5)
    assert want_kl > 0.01  # another model: the term is not vacuous
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), want_grads[name].double(), rtol=1e-4, atol=1e-6)


def test_the_default_reference_is_the_starting_policy_and_stays_frozen(tiny_model_dir):
    state = make_state(tiny_model_dir, loss=RLLossConfig(ref_kl_tau=REF_KL_TAU))
    rows = random_rows(12)
    state, metrics = rl_step(state, rl_batch(rows, own_logprobs(state.handles.model, rows)))
    assert abs(float(metrics["ref_kl/mean"])) < 1e-6  # the same weights at step 1
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, value in state.handles.ref_model.state_dict().items():
        assert torch.equal(value, start[name]), name
    state, metrics = rl_step(state, rl_batch(rows, own_logprobs(state.handles.model, rows)))
    assert float(metrics["ref_kl/mean"]) > 0  # the policy has moved away from it
    assert state.handles.ref_model is not None


def test_with_lora_the_reference_is_the_policy_s_base_and_no_second_model(tiny_model_dir):
    config = RLLossConfig(ref_kl_tau=REF_KL_TAU)
    state = make_state(tiny_model_dir, loss=config, lora=LoraConfig(rank=4, alpha=32.0))
    model, runtime = state.handles.model, state.handles.runtime
    # One model's parameters: the reference is the policy itself, run with its adapters off.
    assert state.handles.ref_model is model
    held = {id(p) for m in (model, state.handles.ref_model) for p in m.parameters()}
    assert held == {id(p) for p in model.parameters()}
    optimized = [p for group in state.handles.optimizer.param_groups for p in group["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in optimized} == {id(p) for p in trainable}
    assert sum(p.numel() for p in trainable) < sum(p.numel() for p in model.parameters()) // 4

    rows = random_rows(14)
    for _ in range(3):  # move the adapters away from zero
        state, metrics = rl_step(state, rl_batch(rows, off_policy_inference(model, rows)))
    assert float(metrics["ref_kl/mean"]) > 1e-4

    separate = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().requires_grad_(False)
    batch = rl_batch(rows, off_policy_inference(model, rows))
    inside = reference_logprobs(model, batch, runtime, 16)
    apart = reference_logprobs(separate, batch, runtime, 16)
    for a, b in zip(inside.micro_batches, apart.micro_batches):
        assert torch.equal(a.ref_logprobs, b.ref_logprobs)
    assert not torch.allclose(own_logprobs(model, rows), apart.micro_batches[0].ref_logprobs)

    with_base = rl_metrics(rl_gradients_(model, batch, runtime, config, 16, model))
    model.zero_grad(set_to_none=True)
    with_separate = rl_metrics(rl_gradients_(model, batch, runtime, config, 16, separate))
    assert float(with_base["ref_kl/mean"]) == float(with_separate["ref_kl/mean"]) > 1e-4


def test_no_reference_model_without_ref_kl(tiny_model_dir):
    state = make_state(tiny_model_dir)
    assert state.handles.ref_model is None


def rl_ranks_job(fixture, out):
    models = [str(fixture("tiny_model_dir")), str(fixture("tiny_reference_dir"))]
    return {"call": "tests.steps.rl_ranks_loop:main", "args": [*models, str(out)]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=rl_ranks_job)
def test_two_ranks_agree_on_skips_and_match_one_rank_with_a_reference(
    tiny_model_dir, reference_dir, two_rank_runs
):
    out = two_rank_runs(rl_ranks_job)
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    # Step 1: rank 0's advantages are all 0, rank 1's are not: both update. Step 2: all 0 on
    # both: both skip, and the weights stay as they were.
    for r in results:
        assert r["skip_rows"] == [
            {"skipped/zero_advantage": 0.0, "optim/skipped": 0.0},
            {"skipped/zero_advantage": 1.0, "optim/skipped": 1.0},
        ]
        assert r["changed_at_step_1"] and not r["changed_at_step_2"]
    assert results[0]["weights_digest"] == results[1]["weights_digest"]

    # The reference-KL step on 2 ranks equals the same step on the full batch in one process.
    config = RLLossConfig(ref_kl_tau=REF_KL_TAU, ref_model=str(reference_dir))
    state = make_state(tiny_model_dir, loss=config)
    rows = random_rows(13)
    inference = off_policy_inference(state.handles.model, rows)
    _, metrics = rl_step(state, rl_batch(rows, inference))
    for key in ("loss/mean", "ref_kl/mean", "optim/grad_norm", "entropy/all/mean"):
        for r in results:
            assert r["ref_row"][key] == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-6), key
