"""Pack scored rollouts into RL micro-batches. Pure: no side effects.

Each completion is one document: its prompt tokens followed by its completion tokens. The rest
of every row is one padding document without loss (fnt.data.packing's convention, so attention
never mixes padding with samples).

Capacity: a rank's samples must fit, first-fit in order, into its batch_size // dp rows of
seq_len tokens (`first_fit`); that is what batch_size promises, and what the errors point at.

Layout (`plan_micro_batches`): the rows are shaped to the samples, not to seq_len. Samples are
taken longest first; a micro-batch's rows are as long as its first (longest) sample, rounded up
to a multiple of ROW_MULTIPLE (at most seq_len), and it has as many rows as fit its token budget
of micro_batch_size * seq_len tokens, each filled first-fit with the next samples in that order.
So a micro-batch holds samples of similar lengths, the padding is small, and the attention cost,
which grows with the square of the row length, follows the sum of the squared sample lengths
rather than seq_len squared. `fixed_layout` is the layout of rows of seq_len in sample order
(the one before); loss and gradients are the same with either (documents never attend across
each other, fnt.model.attention), up to the order of float sums.

Per-token values, aligned with input_ids (the value at t belongs to token t):
- loss_mask: True on the completion tokens, the ones the policy sampled;
- advantages: the document's advantage on all its tokens, 0 on padding;
- temperatures: the sampling temperature everywhere, so dividing logits by it is always defined;
- inference_logprobs: the sampler's logprob on completion tokens, 0 elsewhere.
`sample_lengths` lists the documents of each row without the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fnt.batch import RLMicroBatch
from fnt.data.packing import pack_rows
from fnt.rollout.sampling import Completion

ROW_MULTIPLE = 8
"""Fitted rows are a multiple of this many tokens long, so few distinct shapes occur."""


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which samples go into each row of one micro-batch, and how long its rows are."""

    row_len: int
    rows: tuple[tuple[int, ...], ...]
    """Per row, the indices of its samples, packed in this order."""


@dataclass(frozen=True)
class RolloutSample:
    """One scored completion, ready to pack."""

    prompt_ids: tuple[int, ...]
    completion: Completion
    reward: float
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion.token_ids)


def first_fit(
    lengths: Sequence[int], *, num_rows: int, seq_len: int
) -> tuple[tuple[int, ...], ...]:
    """Indices of the documents in each of num_rows rows, placed greedily first-fit in order."""
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    room = [seq_len] * num_rows
    for i, length in enumerate(lengths):
        if length > seq_len:
            raise ValueError(
                f"a rollout sample (prompt + completion) has {length} tokens, more than "
                f"seq_len = {seq_len}: raise seq_len or lower rollout.max_new_tokens"
            )
        row = next((r for r in range(num_rows) if room[r] >= length), None)
        if row is None:
            raise ValueError(
                f"{len(lengths)} rollout samples of {sum(lengths)} tokens do not fit in this "
                f"rank's {num_rows} rows of seq_len = {seq_len}: raise batch_size (rows per step, "
                f"all ranks) or seq_len, or lower rollout.prompts_per_step, group_size or "
                f"max_new_tokens"
            )
        rows[row].append(i)
        room[row] -= length
    return tuple(tuple(row) for row in rows)


def plan_micro_batches(
    lengths: Sequence[int], *, seq_len: int, micro_batch_size: int
) -> tuple[MicroBatchPlan, ...]:
    """The fitted layout of the module docstring; at least one micro-batch (all padding when
    there are no samples). Every length must be <= seq_len."""
    budget = micro_batch_size * seq_len
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    plans: list[MicroBatchPlan] = []
    i = 0
    while i < len(order):
        row_len = min(seq_len, -(-lengths[order[i]] // ROW_MULTIPLE) * ROW_MULTIPLE)
        rows: list[list[int]] = [[] for _ in range(max(1, budget // row_len))]
        room = [row_len] * len(rows)
        while i < len(order):
            length = lengths[order[i]]
            row = next((r for r in range(len(rows)) if room[r] >= length), None)
            if row is None:
                break
            rows[row].append(order[i])
            room[row] -= length
            i += 1
        plans.append(MicroBatchPlan(row_len, tuple(tuple(r) for r in rows if r)))
    return tuple(plans) or (empty_plan(),)


def micro_batch_count(lengths: Sequence[int], *, seq_len: int, micro_batch_size: int) -> int:
    """How many micro-batches the fitted layout of these sample lengths has."""
    return len(plan_micro_batches(lengths, seq_len=seq_len, micro_batch_size=micro_batch_size))


def fixed_layout(
    lengths: Sequence[int], *, num_rows: int, seq_len: int, micro_batch_size: int
) -> tuple[MicroBatchPlan, ...]:
    """num_rows rows of seq_len tokens, filled first-fit in sample order, in micro-batches of
    micro_batch_size rows (the layout before `plan_micro_batches`)."""
    rows = first_fit(lengths, num_rows=num_rows, seq_len=seq_len)
    return tuple(
        MicroBatchPlan(seq_len, rows[start : start + micro_batch_size])
        for start in range(0, num_rows, micro_batch_size)
    )


def empty_plan() -> MicroBatchPlan:
    """One row of ROW_MULTIPLE padding tokens: a micro-batch that carries no loss."""
    return MicroBatchPlan(ROW_MULTIPLE, ((),))


def pad_plans(
    plans: Sequence[MicroBatchPlan], num_micro_batches: int
) -> tuple[MicroBatchPlan, ...]:
    """`plans` followed by all-padding micro-batches up to num_micro_batches (every rank must
    run the same number of forward/backward passes under FSDP2, see fnt.update)."""
    return (*plans, *[empty_plan()] * (num_micro_batches - len(plans)))


def pack_rollouts(
    samples: Sequence[RolloutSample],
    *,
    num_rows: int,
    seq_len: int,
    micro_batch_size: int,
    temperature: float,
    pad_token_id: int,
    num_micro_batches: int = 1,
    fitted: bool = True,
) -> tuple[RLMicroBatch, ...]:
    """This rank's micro-batches: the fitted layout (or with `fitted=False` the fixed one), at
    least num_micro_batches of them. The samples must fit num_rows rows of seq_len (`first_fit`).
    """
    if num_rows < 1 or micro_batch_size < 1 or num_rows % micro_batch_size:
        raise ValueError(
            f"{num_rows} rows per rank do not split into micro-batches of {micro_batch_size} rows"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lengths = [s.length for s in samples]
    first_fit(lengths, num_rows=num_rows, seq_len=seq_len)  # the capacity check
    if fitted:
        plans = plan_micro_batches(lengths, seq_len=seq_len, micro_batch_size=micro_batch_size)
    else:
        plans = fixed_layout(
            lengths, num_rows=num_rows, seq_len=seq_len, micro_batch_size=micro_batch_size
        )
    return tuple(
        _micro_batch(
            [[samples[i] for i in row] for row in plan.rows],
            seq_len=plan.row_len,
            temperature=temperature,
            pad_token_id=pad_token_id,
        )
        for plan in pad_plans(plans, num_micro_batches)
    )


def _micro_batch(
    rows: list[list[RolloutSample]], *, seq_len: int, temperature: float, pad_token_id: int
) -> RLMicroBatch:
    documents = [[_document(s) for s in row] for row in rows]
    packed = pack_rows(documents, seq_len=seq_len, pad_token_id=pad_token_id)
    advantages = torch.zeros(len(rows), seq_len, dtype=torch.float32)
    logprobs = torch.zeros(len(rows), seq_len, dtype=torch.float32)
    for r, row in enumerate(rows):
        t = 0
        for s in row:
            advantages[r, t : t + s.length] = s.advantage
            prompt_end = t + len(s.prompt_ids)
            logprobs[r, prompt_end : t + s.length] = torch.tensor(
                s.completion.logprobs, dtype=torch.float32
            )
            t += s.length
    return RLMicroBatch(
        rows=packed,
        advantages=advantages,
        temperatures=torch.full((len(rows), seq_len), temperature, dtype=torch.float32),
        inference_logprobs=logprobs,
        sample_lengths=tuple(tuple(s.length for s in row) for row in rows),
    )


def _document(sample: RolloutSample) -> tuple[torch.Tensor, torch.Tensor]:
    completion = sample.completion.token_ids
    ids = torch.tensor([*sample.prompt_ids, *completion], dtype=torch.int64)
    mask = torch.tensor([False] * len(sample.prompt_ids) + [True] * len(completion))
    return ids, mask
