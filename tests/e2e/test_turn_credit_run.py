"""`fnt rl` with rollout.credit = "turn" end to end: the feedback environment's turn rewards,
episodes of several turns whose turns train on different advantages, and an exact resume."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import assert_resumed_run_matches, copy_crashed_run, read_metrics, run_cli
from tests.e2e.test_rl_run import EXACT, MULTI_TURN, rl_args

TURN_CREDIT = (
    *MULTI_TURN,
    "--rollout.credit",
    "turn",
    "--rollout.turn-discount",
    "0.5",
    "--rollout.log-samples-every",
    "1",
)


@pytest.mark.numerics
def test_a_turn_credit_run_trains_each_turn_on_its_own_advantage_and_resumes_exactly(
    policy_dir, tmp_path
):
    full = tmp_path / "full"
    run_cli("rl", *rl_args(policy_dir, full, *TURN_CREDIT, "--ckpt.interval", "2"))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["rollout/turns/mean"] > 1 for r in rows)
    samples = [
        json.loads(line)
        for step in range(1, 5)
        for line in (full / "samples" / f"step_{step}.jsonl").read_text().splitlines()
    ]
    multi = [s for s in samples if s["turns"] > 1]
    assert multi and all(len(s["turn_rewards"]) == s["turns"] for s in samples)
    # A turned-down answer costs its shortfall, so an episode's turns differ in advantage.
    assert any(len(set(s["turn_advantages"])) > 1 for s in multi)
    assert all(s["advantage"] == s["turn_advantages"][0] for s in samples)

    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *rl_args(policy_dir, resumed, *TURN_CREDIT, "--resume", "latest"))
    keys = (*EXACT, "rollout/turns/mean", "reward/final/mean")
    assert_resumed_run_matches(full, resumed, 2, 4, keys, tmp_path)
