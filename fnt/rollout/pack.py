"""Pack scored rollouts into RL micro-batches. Pure: no side effects.

Each completion is one document: its prompt tokens followed by its completion tokens. Documents
go into a fixed number of rows of seq_len tokens, greedy first-fit in order (each into the first
row with room). The rest of every row is one padding document without loss (fnt.data.packing's
convention, so attention never mixes padding with samples).

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
from fnt.rollout.generate import Completion


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


def pack_rollouts(
    samples: Sequence[RolloutSample],
    *,
    num_rows: int,
    seq_len: int,
    micro_batch_size: int,
    temperature: float,
    pad_token_id: int,
) -> tuple[RLMicroBatch, ...]:
    """Exactly num_rows rows of seq_len tokens, in micro-batches of micro_batch_size rows."""
    if num_rows < 1 or micro_batch_size < 1 or num_rows % micro_batch_size:
        raise ValueError(
            f"{num_rows} rows per rank do not split into micro-batches of {micro_batch_size} rows"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = first_fit([s.length for s in samples], num_rows=num_rows, seq_len=seq_len)
    return tuple(
        _micro_batch(
            [[samples[i] for i in row] for row in rows[start : start + micro_batch_size]],
            seq_len=seq_len,
            temperature=temperature,
            pad_token_id=pad_token_id,
        )
        for start in range(0, num_rows, micro_batch_size)
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
