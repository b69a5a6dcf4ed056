"""Group-relative advantages (GRPO style). Pure: no side effects.

Each prompt's completions form a group; a completion's advantage is its reward minus the group's
mean, divided by (the group's standard deviation + eps) when std-normalizing. The std is the
population std (divide by the group size), so a group of one is defined and gets advantage 0. A
group whose rewards are all equal carries no learning signal and gets exactly zero advantages.

Per-turn credit (rollout.credit = "turn", `turn_advantages`): turn k of an episode of T turns
with rewards r_1..r_T gets the return-to-go G_k = sum over j >= k of discount^(j-k) r_j
(`discounted_returns`), so G_1 is the episode's whole return. The group's baseline and scale are
those of its episodes' whole returns G_1, one value per episode, computed as above: turn k's
advantage is (G_k - mean G_1) / (std G_1 + eps). A baseline that is one number per group is the
same for every action, whatever turn the episode stops at, so it adds no bias to the policy
gradient. A group whose episodes' whole returns are all equal gets zeros, as equal rewards do.
Normalizing over the turns instead (each turn index k by its own mean over the episodes that
reached k, or every turn of every episode pooled) makes an episode's baseline depend on how
many turns it took, so when the policy decides when to stop, stopping early or late is
credited by the baseline as well as by the rewards (verl RFC #7244).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

EPS = 1e-4
"""Added to the group std; keeps nearly-equal rewards from turning noise into large advantages."""


def group_advantages(
    rewards: Sequence[Sequence[float]] | Tensor, *, std_normalize: bool, eps: float = EPS
) -> Tensor:
    """Advantages [G, S] float32 of rewards [G, S] (G groups of S completions each)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 2 or r.shape[1] < 1:
        raise ValueError(
            f"rewards must be [groups, group_size] with group_size >= 1, got {tuple(r.shape)}"
        )
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    centered = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        centered = centered / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    # The mean of equal floats can differ from them in the last bit; such a group must be 0.
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, 0.0, centered).to(torch.float32)


def discounted_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """The return-to-go of each turn: G_k = r_k + discount * G_(k+1), G after the last = 0."""
    returns, ahead = [], 0.0
    for reward in reversed(rewards):
        ahead = reward + discount * ahead
        returns.append(ahead)
    return returns[::-1]


def turn_advantages(
    returns: Sequence[Sequence[float]], *, std_normalize: bool, eps: float = EPS
) -> list[list[float]]:
    """Per episode of one group, the advantage of each of its turns (module docstring) from the
    turns' returns-to-go (`discounted_returns`), as float32 values like `group_advantages`'.
    A group whose episodes' whole returns G_1 are all equal gets exactly zeros, as a group of
    equal rewards does: its baseline is each episode's own return and its scale eps alone."""
    if not returns or any(not r for r in returns):
        raise ValueError("every episode of a group needs at least one turn")
    if not all(math.isfinite(g) for episode in returns for g in episode):
        raise ValueError("returns must be finite")
    whole = torch.tensor([[episode[0] for episode in returns]], dtype=torch.float64)
    if bool((whole == whole[0, 0]).all()):
        return [[0.0] * len(episode) for episode in returns]
    # The same operations as group_advantages on [1, S], so that zero turn rewards and
    # discount 1 give exactly the advantages of episode credit.
    baseline = whole.mean(dim=1, keepdim=True)[0]
    scale = whole.std(dim=1, unbiased=False, keepdim=True)[0] + eps
    advantages = []
    for episode in returns:
        centered = torch.tensor(episode, dtype=torch.float64) - baseline
        if std_normalize:
            centered = centered / scale
        advantages.append(centered.to(torch.float32).tolist())
    return advantages
