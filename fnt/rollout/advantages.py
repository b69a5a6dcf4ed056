"""Group-relative advantages (GRPO style). Pure: no side effects.

Each prompt's completions form a group; a completion's advantage is its reward minus the group's
mean, divided by (the group's standard deviation + eps) when std-normalizing. The std is the
population std (divide by the group size), so a group of one is defined and gets advantage 0. A
group whose rewards are all equal carries no learning signal and gets exactly zero advantages.

Per-turn credit (rollout.credit = "turn", `turn_advantages`): turn k of an episode of T turns
with rewards r_1..r_T gets the return-to-go G_k = sum over j >= k of discount^(j-k) r_j
(`discounted_returns`), so G_1 is the episode's whole return. Each turn index k is a group of
its own: the returns G_k of the group's episodes that reached turn k are normalized as rewards
are above, so every episode's first turn is credited as under episode credit, and a turn
reached by one episode alone, or by episodes of equal returns there, gets 0. (One baseline for
all turns, the mean of G_1, would be unbiased but leaves every later turn offset by the rewards
before it; on the reverse-text demo it collapsed training.) The known bias (verl RFC #7244):
an episode's own return is part of its baseline at turn k with weight 1/n_k, n_k the episodes
that went on to turn k, which the policy's decisions to stop set; so an episode that goes on
when the others of its group stop has its later turns credited less, down to nothing when it is
the only one (a plain group of equal size shrinks every advantage alike), and summing such
per-turn advantages into one per episode would add a bias per turn taken as well.
"""

from __future__ import annotations

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
    """Per episode of one group, the advantage of each of its turns from the turns'
    returns-to-go (`discounted_returns`): turn index k normalized over the episodes that
    reached it, by `group_advantages` (module docstring); float32 values."""
    if not returns or any(not r for r in returns):
        raise ValueError("every episode of a group needs at least one turn")
    advantages = [[0.0] * len(episode) for episode in returns]
    for k in range(max(map(len, returns))):
        members = [i for i, episode in enumerate(returns) if len(episode) > k]
        values = group_advantages(
            [[returns[i][k] for i in members]], std_normalize=std_normalize, eps=eps
        )[0].tolist()
        for i, value in zip(members, values):
            advantages[i][k] = value
    return advantages
