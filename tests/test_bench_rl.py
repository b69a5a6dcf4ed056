"""scripts/bench_rl.py --multi-turn (slow: it trains the demo's SFT model first): the JSON line
compares 3-turn episodes of the starting policy with single-turn ones of about as many sampled
tokens."""

from __future__ import annotations

import pytest

from tests.test_gpu_check import run_json


@pytest.mark.slow
def test_the_multi_turn_comparison_keeps_three_turns_and_matches_the_sampled_tokens(tmp_path):
    result = run_json(
        *("scripts/bench_rl.py", "--multi-turn", "--steps", "2", "--warmup", "1"),
        *("--work", str(tmp_path)),
        timeout=900,
    )
    assert result["case"] == "multi_turn" and result["steps"] == 2
    # The starting policy answers within max_new_tokens, so nearly every episode runs 3 turns
    # (a learning one drifted to 1); single-turn prompts are sized to the same sampled tokens.
    assert result["multi_turn_turns_mean"] > 2.8 and result["single_turn_turns_mean"] == 1.0
    multi, single = result["multi_turn_sampled_tokens"], result["single_turn_sampled_tokens"]
    assert abs(multi - single) < 0.25 * multi, (multi, single)
    for side in ("multi_turn", "single_turn"):
        assert result[f"{side}_rollout_s"] > 0 and result[f"{side}_update_s"] > 0
        assert result[f"{side}_all_tok_s"] > result[f"{side}_sampled_tok_s"] > 0
    ratio = result["single_turn_sampled_tok_s"] / result["multi_turn_sampled_tok_s"]
    assert result["tok_s_ratio"] == pytest.approx(ratio)
    all_ratio = result["single_turn_all_tok_s"] / result["multi_turn_all_tok_s"]
    assert result["all_tok_s_ratio"] == pytest.approx(all_ratio)
    # The same episodes under rollout.lockstep: the same samples, at their own speed.
    assert result["same_samples"] is True and result["multi_turn_lockstep_turns_mean"] > 2.8
    lockstep = result["single_turn_sampled_tok_s"] / result["multi_turn_lockstep_sampled_tok_s"]
    assert result["lockstep_tok_s_ratio"] == pytest.approx(lockstep)


LONG_TAIL_KEYS = (
    "step_s",
    "rollout_s",
    "update_s",
    "env_latency_s",
    "sampled_tokens",
    "s_per_sampled_token",
    "turns_mean",
    "reward_mean",
)


def check_long_tail(result: dict) -> None:
    """What every --long-tail JSON line holds, whatever the model: both schedules' numbers, the
    same samples under both, and ratios that are the sides' quotients."""
    assert result["case"] == "long_tail" and result["episodes_per_step"] == 64
    assert result["latency_ms"] > 0 and result["env_concurrency"] >= 1
    for side in ("lockstep", "independent"):
        for key in LONG_TAIL_KEYS:
            assert f"{side}_{key}" in result, (side, key)
        assert result[f"{side}_rollout_s"] > 0 and result[f"{side}_update_s"] > 0
        assert 1 <= result[f"{side}_turns_mean"] <= 8
    # The schedule decides when turns are sampled, never what: the same seed, prompts and
    # policy give the same tokens and rewards, and the environment is asked the same calls.
    assert result["same_samples"] is True
    for key in ("sampled_tokens", "turns_mean", "reward_mean", "env_latency_s"):
        assert result[f"lockstep_{key}"] == pytest.approx(result[f"independent_{key}"]), key
    for name, key in (
        ("step_s_ratio", "step_s"),
        ("rollout_s_ratio", "rollout_s"),
        ("per_sampled_token_ratio", "s_per_sampled_token"),
    ):
        expected = result[f"lockstep_{key}"] / result[f"independent_{key}"]
        assert result[name] == pytest.approx(expected), name


@pytest.mark.slow
def test_the_long_tail_comparison_runs_end_to_end_and_prints_its_json_last(tmp_path):
    """At the demo's base model (no SFT first: its turns run to max_new_tokens, so episodes are
    short), one measured step of each schedule."""
    result = run_json(
        *("scripts/bench_rl.py", "--long-tail", "--steps", "1", "--warmup", "1"),
        *("--work", str(tmp_path), "--model", str(tmp_path / "reverse-model")),
        timeout=600,
    )
    assert result["steps"] == 1
    check_long_tail(result)


@pytest.mark.slow
def test_the_long_tail_comparison_runs_long_tailed_episodes_from_the_sft_model(tmp_path):
    result = run_json(
        *("scripts/bench_rl.py", "--long-tail", "--steps", "2", "--warmup", "1"),
        *("--work", str(tmp_path)),
        timeout=900,
    )
    check_long_tail(result)
    # The SFT model ends its turns, so the environment decides the episodes' lengths: 2.6
    # turns on average over the prompts (bench_rl_env.TURN_WEIGHTS), every call sleeping.
    assert result["independent_turns_mean"] > 1.5
    assert result["independent_env_latency_s"] > 0
