"""Group-relative advantages (GRPO style). Pure: no side effects.

Each prompt's completions form a group; a completion's advantage is its reward minus the group's
mean, divided by (the group's standard deviation + eps) when std-normalizing. The std is the
population std (divide by the group size), so a group of one is defined and gets advantage 0. A
group whose rewards are all equal carries no learning signal and gets exactly zero advantages.
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
