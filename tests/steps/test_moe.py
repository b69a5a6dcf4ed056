"""MoE router statistics: definitions on hand-made logits, presence in rows, rank reduction."""

from __future__ import annotations

import pytest
import torch

from fnt.data.synthetic import synthetic_rows
from fnt.model.moe import moe_metrics, router_stats
from steps.sft import sft_step
from tests.e2e.helpers import config_args, read_metrics, run_cli
from tests.steps.test_sft import batch_of, make_state

MOE_KEYS = {"max_vio/mean", "routing_confidence/mean"}


def test_balanced_routing_has_zero_violation():
    # 4 tokens, 4 experts, top-2: token i prefers experts i and i+1 (mod 4), so each gets 2.
    logits = torch.full((4, 4), -30.0)
    for i in range(4):
        logits[i, i] = logits[i, (i + 1) % 4] = 10.0
    metrics = moe_metrics(router_stats([logits], top_k=2))
    assert float(metrics["max_vio/mean"]) == pytest.approx(0.0)
    assert float(metrics["routing_confidence/mean"]) == pytest.approx(0.5, abs=1e-6)


def test_collapsed_routing_violation_and_confidence():
    # Every token sends both slots to experts 0 and 1: loads [n, n, 0, 0], fair share n/2.
    logits = torch.tensor([[5.0, 5.0, 0.0, 0.0]]).repeat(6, 1)
    stats = router_stats([logits, torch.zeros(6, 4)], top_k=2)
    metrics = moe_metrics(stats)
    probs = torch.softmax(torch.tensor([5.0, 5.0, 0.0, 0.0]), -1)
    # Layer 1: max_vio 1; layer 2 (uniform logits): topk ties pick 2 experts for every token,
    # which is again a violation of 1. Confidence: layer 1 probs[0], layer 2 0.25.
    assert float(metrics["max_vio/mean"]) == pytest.approx(1.0)
    assert float(metrics["routing_confidence/mean"]) == pytest.approx((float(probs[0]) + 0.25) / 2)


def test_stats_add_up_over_micro_batches():
    a, b = torch.randn(5, 4), torch.randn(7, 4)
    together = router_stats([torch.cat([a, b])], top_k=2)
    torch.testing.assert_close(router_stats([a], 2) + router_stats([b], 2), together)


def test_moe_rows_carry_the_stats_and_dense_rows_do_not(tiny_model_dir, tiny_moe_dir):
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=2, seq_len=32)
    _, dense = sft_step(make_state(tiny_model_dir), batch_of(rows, 1))
    _, moe = sft_step(make_state(tiny_moe_dir), batch_of(rows, 1))
    assert not MOE_KEYS & dense.keys()
    assert MOE_KEYS <= moe.keys()
    assert float(moe["max_vio/mean"]) >= 0.0
    assert 0.0 < float(moe["routing_confidence/mean"]) <= 1.0


def moe_args(model_dir, out) -> list[str]:
    return [*config_args("examples/debug/sft.toml", model_dir, out), "--max-steps", "2"]


def moe_job(fixture, out):
    args = moe_args(fixture("tiny_moe_dir"), out / "run")
    return {"call": "fnt.__main__:main", "args": [["sft", *args]]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=moe_job)
def test_moe_stats_are_reduced_across_ranks(tiny_moe_dir, tmp_path, two_rank_runs):
    run_cli("sft", *moe_args(tiny_moe_dir, tmp_path / "moe"))
    one, two = read_metrics(tmp_path / "moe"), read_metrics(two_rank_runs(moe_job) / "run")
    for r1, r2 in zip(one, two):
        for key in MOE_KEYS:
            assert r2[key] == pytest.approx(r1[key], abs=1e-5)
