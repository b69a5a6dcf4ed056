"""Each data-parallel rank's share of a step's items (prompts, samples, rows), and the check
that a batch splits evenly over the ranks (the rule is fnt.config.parallel's). Pure."""

from __future__ import annotations

from typing import Any, Sequence

from fnt.config.parallel import batch_layout_problem


def rank_bounds(count: int, dp_rank: int, dp_size: int, *, what: str) -> tuple[int, int]:
    """[lo, hi) of data-parallel rank dp_rank's contiguous share of `count` items; ValueError
    naming `what` the items are when they do not split evenly."""
    if count % dp_size:
        raise ValueError(
            f"{count} {what} do not split evenly over {dp_size} data-parallel ranks: "
            f"make them a multiple of {dp_size}"
        )
    per_rank = count // dp_size
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


def rank_share(items: Sequence[Any], dp_rank: int, dp_size: int, *, what: str) -> tuple[Any, ...]:
    """Rank dp_rank's contiguous share of a step's items (prompts, samples, rows)."""
    lo, hi = rank_bounds(len(items), dp_rank, dp_size, what=what)
    return tuple(items[lo:hi])


def check_batch_layout(
    batch_size: int, micro_batch_size: int, *, dp_rank: int, dp_size: int
) -> None:
    """ValueError unless this rank exists and the batch splits evenly (`batch_layout_problem`)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    problem = batch_layout_problem(batch_size, micro_batch_size, dp_size)
    if problem is not None:
        raise ValueError(problem)
