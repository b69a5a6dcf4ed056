"""Saving a step's RL samples as text, with their tokens and the spans of them that were trained
(fnt.store.samples' files), from every engine. Side effects: an all-gather of the records
across ranks on a sample step, and rank 0's file.

Each rank decodes its own samples; the records are gathered to every rank (a step's samples are
few next to its tensors, and only sample steps pay) and rank 0 writes them in rank order, which
is the step's prompt order, since each rank's share is a contiguous run of the step's prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fnt.config import RLConfig
from fnt.distributed.collectives import all_gather_objects
from fnt.distributed.runtime import Runtime
from fnt.obs.metrics import finite_or_none
from fnt.rollout.pack import RolloutSample
from fnt.store.samples import is_sample_step, write_step_samples_


def trained_spans(sampled: Sequence[bool]) -> list[list[int]]:
    """The [start, end) token offsets of each run of sampled tokens, in order: the spans the
    policy sampled and the loss trains (fnt.rollout.pack). Pure."""
    spans: list[list[int]] = []
    for i, flag in enumerate(sampled):
        if flag and (not i or not sampled[i - 1]):
            spans.append([i, i + 1])
        elif flag:
            spans[-1][1] = i + 1
    return spans


def sample_record(sample: RolloutSample, tokenizer: Any) -> dict[str, Any]:
    """One sample as text: the prompt (the tokens before the first sampled one) and the
    completion (the rest: the sampled turns and, in an episode, the environment's replies in
    between), decoded with their special tokens, with its reward (None when not finite) and facts,
    then what was trained: `trained`, the [start, end) offsets of the sampled spans in
    `token_ids`, the sample's whole token sequence; under rollout.credit = "turn" also the
    advantage of each trained span and the turn rewards. Pure but for the tokenizer."""
    first = sample.sampled.index(True)
    record = {
        "prompt": tokenizer.decode(list(sample.token_ids[:first])),
        "completion": tokenizer.decode(list(sample.token_ids[first:])),
        "reward": finite_or_none(sample.reward),
        "advantage": finite_or_none(sample.advantage),
        "completion_tokens": sample.sampled_count,
        "turns": sample.turns,
        "truncated": sample.truncated,
        "out_of_turns": sample.out_of_turns,
        "policy_step": sample.policy_step,
    }
    if sample.environment:  # a mixture's (rollout.environments): which member ran it
        record["environment"] = sample.environment
    if sample.named_rewards:
        record["rewards"] = {name: finite_or_none(v) for name, v in sample.named_rewards}
    if sample.continued:  # its episode goes on in the next sample (a rewritten history)
        record["continued"] = True
    if getattr(sample, "env_failed", False):  # its environment crashed or hung
        record["env_failed"] = True
    record["trained"] = trained_spans(sample.sampled)
    if sample.token_advantages is not None:  # rollout.credit = "turn": one per trained span
        record["turn_advantages"] = [sample.token_advantages[a] for a, _ in record["trained"]]
        turn_rewards = getattr(sample, "turn_rewards", ())
        record["turn_rewards"] = [finite_or_none(r) for r in turn_rewards]
    record["token_ids"] = list(sample.token_ids)
    return record


def save_samples_(
    config: RLConfig,
    runtime: Runtime,
    step: int,
    samples: Sequence[RolloutSample],
    tokenizer: Any,
) -> None:
    """On a sample step (`rollout.log_samples_every`), write every rank's `samples` of update
    `step` to {output_dir}/samples/step_N.jsonl (rank 0); every rank must call it."""
    if not is_sample_step(step, config.rollout.log_samples_every, config.max_steps):
        return
    mine = [sample_record(sample, tokenizer) for sample in samples]
    gathered = all_gather_objects(mine, runtime.distributed)
    if not runtime.is_main:
        return
    records = []
    for rank, records_of_rank in enumerate(gathered):
        for record in records_of_rank:
            records.append({"step": step, "index": len(records), "rank": rank, **record})
    write_step_samples_(config.output_dir, step, records)
