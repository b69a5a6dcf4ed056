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
