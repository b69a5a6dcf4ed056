"""group_advantages: centering, std normalization, equal groups, shapes. Hypothesis properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from fnt.rollout import group_advantages
from fnt.rollout.advantages import EPS

reward = st.floats(-100, 100, allow_nan=False, width=32)


@st.composite
def groups(draw, min_size=1):
    size = draw(st.integers(min_size, 8))
    return draw(st.lists(st.lists(reward, min_size=size, max_size=size), min_size=1, max_size=5))


@given(rewards=groups(), normalize=st.booleans())
def test_advantages_are_centered_per_group(rewards, normalize):
    adv = group_advantages(rewards, std_normalize=normalize)
    assert adv.shape == (len(rewards), len(rewards[0])) and adv.dtype == torch.float32
    scale = 1.0 if normalize else max(1.0, max(abs(x) for g in rewards for x in g))
    torch.testing.assert_close(
        adv.double().mean(dim=1),
        torch.zeros(len(rewards), dtype=torch.float64),
        rtol=0,
        atol=1e-5 * scale,
    )


@given(value=reward, size=st.integers(1, 8), normalize=st.booleans())
def test_a_group_of_equal_rewards_gets_exactly_zero(value, size, normalize):
    adv = group_advantages([[value] * size, [0.0] * (size - 1) + [1.0]], std_normalize=normalize)
    assert bool((adv[0] == 0).all())


@given(rewards=groups(min_size=2))
def test_without_normalization_the_advantage_is_reward_minus_group_mean(rewards):
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = (r - r.mean(dim=1, keepdim=True)).float()
    expected[(r == r[:, :1]).all(dim=1)] = 0.0
    torch.testing.assert_close(group_advantages(rewards, std_normalize=False), expected)


@given(rewards=groups(min_size=2), shift=st.floats(-50, 50), scale=st.floats(0.5, 20))
def test_normalized_advantages_ignore_shift_and_scale_of_spread_out_rewards(rewards, shift, scale):
    r = torch.tensor(rewards, dtype=torch.float64)
    assume(bool((r.std(dim=1, unbiased=False) > 0.1).all()))
    base = group_advantages(r, std_normalize=True)
    moved = group_advantages(r * scale + shift, std_normalize=True)
    torch.testing.assert_close(moved, base, rtol=0, atol=1e-2)
    # Population std of the advantages is std / (std + eps), just under 1.
    torch.testing.assert_close(
        base.double().std(dim=1, unbiased=False),
        torch.ones(len(rewards), dtype=torch.float64),
        rtol=0,
        atol=EPS * 10 + 1e-5,
    )


def test_two_completion_group_with_std_normalization():
    adv = group_advantages([[0.0, 1.0]], std_normalize=True)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5]]) / (0.5 + EPS))


@pytest.mark.parametrize(
    ("rewards", "message"),
    [([1.0, 2.0], r"\[groups, group_size\]"), ([[1.0, float("nan")]], "finite")],
)
def test_bad_rewards_are_rejected(rewards, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, std_normalize=True)
