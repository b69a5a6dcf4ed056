"""The RL sample format and packing it into micro-batches. Pure: no side effects.

A sample is a token-exact trajectory (`RolloutSample`), one flat token branch: every token of
the episode in order, a mask of the tokens the policy sampled, the sampler's logprob on each of
those, the episode's reward and advantage (or, with per-turn credit, each sampled token's
advantage), and facts about the episode (turns, tool calls,
truncation, the policy step that sampled it). Only sampled tokens get loss, logprobs and
advantages in the loss; the prompt, the tool results and the feedback in between are context.
A single-turn sample is the special case with one sampled span at the end (`single_turn`).

Each sample is one document. The rest of every row is one padding document without loss
(fnt.data.packing's convention, so attention never mixes padding with samples).

Capacity: a step is its episodes (prompts_per_step x group_size, whatever their turns made
of them), not a number of rows. A rank's samples take as many micro-batches as they need, each
within the token budget of micro_batch_size rows of seq_len, so a step whose episodes outgrow
its batch_size // dp rows runs more micro-batches instead of failing: memory per forward/backward
stays the same, the loss is still normalised over the whole step (fnt.update) and there is still
one optimizer update. Only a single sample longer than seq_len cannot be placed
(`require_sample_lengths`).

Layout (`plan_micro_batches`): the rows are shaped to the samples, not to seq_len. Samples are
taken longest first; a micro-batch's rows are as long as its first (longest) sample, rounded up
to a multiple of ROW_MULTIPLE (at most seq_len), and it has as many rows as fit its token budget
of micro_batch_size * seq_len tokens, each filled first-fit with the next samples in that order.
So a micro-batch holds samples of similar lengths, the padding is small, and the attention cost,
which grows with the square of the row length, follows the sum of the squared sample lengths
rather than seq_len squared. `fixed_layout` is the layout of rows of seq_len in sample order
(the one before, grown by whole micro-batches when the samples need more rows than
num_rows); loss and gradients are the same with either (documents never attend across
each other, fnt.model.attention), up to the order of float sums.

Per-token values, aligned with input_ids (the value at t belongs to token t):
- loss_mask: the sample's `sampled` mask, True on the tokens the policy sampled;
- advantages: the document's advantage on all its tokens, or its `token_advantages` where it
  has them (rollout.credit = "turn"), 0 on padding (the loss reads it on loss tokens only);
- temperatures: the sampling temperature everywhere, so dividing logits by it is always defined;
- inference_logprobs: the sampler's logprob on sampled tokens, 0 elsewhere.
`sample_lengths` lists the documents of each row without the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

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
    """One scored trajectory, ready to pack: a flat token branch (module docstring)."""

    token_ids: tuple[int, ...]  # [L] every token of the episode, context and sampled
    sampled: tuple[bool, ...]  # [L] True on the tokens the policy sampled (they get loss)
    logprobs: tuple[float, ...]  # [L] the sampler's logprob on sampled tokens, 0.0 elsewhere
    reward: float
    """The episode's reward (the weighted sum of `named_rewards` when it has those)."""
    advantage: float
    """The episode's advantage, on each of its sampled tokens."""
    turns: int = 1
    """Model turns of the episode (sampled spans)."""
    tool_calls: int = 0
    """Tool calls the environment ran for the episode."""
    tool_errors: int = 0
    """Of those, the ones that failed (a raising tool, a malformed call, an unknown tool)."""
    truncated: bool = False
    """A length limit cut the episode (max_new_tokens in a turn, max_episode_tokens)."""
    out_of_turns: bool = False
    """The episode's last allowed turn (rollout.max_turns) was answered: an outcome of its own,
    not truncation."""
    policy_step: Optional[int] = None
    """The policy step (updates done) whose weights sampled it, when known."""
    named_rewards: tuple[tuple[str, float], ...] = ()
    """(name, value) of each named reward the environment gave, before weighting."""
    continued: bool = False
    """The episode goes on in a later sample (its environment rewrote the history after this
    one's last turn); the episode is counted, and its reward and facts, on its last sample."""
    token_advantages: Optional[tuple[float, ...]] = None
    """[L] each token's own advantage (rollout.credit = "turn": its turn's, 0.0 on context),
    trained in place of `advantage`; None: `advantage` on every token."""
    environment: str = ""
    """The mixture member (rollout.environments) whose episode it is; "": no mixture."""

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def sampled_count(self) -> int:
        """The tokens the policy sampled (the sample's loss tokens)."""
        return sum(self.sampled)

    def check(self) -> None:
        """ValueError unless the per-token fields line up and a loss token can exist: the
        first token is context (nothing predicts it), at least one token is sampled, logprobs
        are 0 off the sampled tokens."""
        n = len(self.token_ids)
        if len(self.sampled) != n or len(self.logprobs) != n:
            raise ValueError(
                f"a rollout sample has {n} tokens but {len(self.sampled)} mask values and "
                f"{len(self.logprobs)} logprobs"
            )
        if self.token_advantages is not None and len(self.token_advantages) != n:
            raise ValueError(
                f"a rollout sample has {n} tokens but {len(self.token_advantages)} token advantages"
            )
        if not n or self.sampled[0]:
            raise ValueError("a rollout sample must start with a context token (not sampled)")
        if not any(self.sampled):
            raise ValueError("a rollout sample has no sampled token")
        if any(lp != 0.0 for lp, s in zip(self.logprobs, self.sampled) if not s):
            raise ValueError("a rollout sample has logprobs on tokens it did not sample")


def single_turn(
    prompt_ids: Sequence[int],
    completion: Completion,
    reward: float,
    advantage: float,
    **facts,
) -> RolloutSample:
    """The sample of one completion of a prompt: one sampled span after the prompt; truncated
    when max_new_tokens cut the completion off."""
    prompt, sampled = tuple(prompt_ids), completion.token_ids
    return RolloutSample(
        token_ids=prompt + sampled,
        sampled=(False,) * len(prompt) + (True,) * len(sampled),
        logprobs=(0.0,) * len(prompt) + tuple(completion.logprobs),
        reward=reward,
        advantage=advantage,
        **{"truncated": not completion.stopped, **facts},
    )


def require_sample_lengths(lengths: Sequence[int], *, seq_len: int) -> None:
    """ValueError for the first sample longer than a row of seq_len tokens: the one thing no
    number of rows can hold."""
    for length in lengths:
        if length > seq_len:
            raise ValueError(
                f"a rollout sample (all its turns) has {length} tokens, more than "
                f"seq_len = {seq_len}: raise seq_len or lower rollout.max_new_tokens"
            )


def first_fit(
    lengths: Sequence[int], *, num_rows: int, seq_len: int
) -> tuple[tuple[int, ...], ...]:
    """Indices of the documents in each row, placed greedily first-fit in order into num_rows
    rows of seq_len tokens, and into new rows after them when none of those has room (so at
    least num_rows rows, more when the documents need them)."""
    require_sample_lengths(lengths, seq_len=seq_len)
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    room = [seq_len] * num_rows
    for i, length in enumerate(lengths):
        row = next((r for r in range(len(rows)) if room[r] >= length), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room.append(seq_len)
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
    """num_rows rows of seq_len tokens (more, by whole micro-batches, when the samples need
    them), filled first-fit in sample order, in micro-batches of micro_batch_size rows (the
    layout before `plan_micro_batches`)."""
    rows = first_fit(lengths, num_rows=num_rows, seq_len=seq_len)
    rows += ((),) * (-len(rows) % micro_batch_size)
    return tuple(
        MicroBatchPlan(seq_len, rows[start : start + micro_batch_size])
        for start in range(0, len(rows), micro_batch_size)
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
    least num_micro_batches of them, and more when the samples need more than num_rows rows
    (module docstring: Capacity). Every sample must fit one row of seq_len."""
    if num_rows < 1 or micro_batch_size < 1 or num_rows % micro_batch_size:
        raise ValueError(
            f"{num_rows} rows per rank do not split into micro-batches of {micro_batch_size} rows"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for sample in samples:
        sample.check()
    lengths = [s.length for s in samples]
    require_sample_lengths(lengths, seq_len=seq_len)
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
            if s.token_advantages is None:
                advantages[r, t : t + s.length] = s.advantage
            else:
                advantages[r, t : t + s.length] = torch.tensor(
                    s.token_advantages, dtype=torch.float32
                )
            logprobs[r, t : t + s.length] = torch.tensor(s.logprobs, dtype=torch.float32)
            t += s.length
    return RLMicroBatch(
        rows=packed,
        advantages=advantages,
        temperatures=torch.full((len(rows), seq_len), temperature, dtype=torch.float32),
        inference_logprobs=logprobs,
        sample_lengths=tuple(tuple(s.length for s in row) for row in rows),
    )


def _document(sample: RolloutSample) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(sample.token_ids, dtype=torch.int64), torch.tensor(sample.sampled)
