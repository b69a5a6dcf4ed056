"""The flat trajectory sample: only the sampled tokens of a multi-turn sample train. Its context
tokens (prompt, tool results, feedback) get exactly zero gradient, the values the batch holds
at them change nothing, and the "sequence" aggregation counts the sampled tokens only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fnt.batch import DataPosition, RLBatch
from fnt.config import RLLossConfig
from fnt.model.lm_head import TokenLogprobs
from fnt.rollout import Completion
from fnt.rollout.pack import RolloutSample, pack_rollouts, single_turn
from steps.rl import loss_inputs, rl_gradients_

from .conftest import one_process_runtime

PAD = 257


def multi_turn(seed: int, advantage: float) -> RolloutSample:
    """prompt (6) | turn 1 (4 sampled) | tool result (5) | turn 2 (3 sampled) | feedback (4) |
    turn 3 (2 sampled), with sampler logprobs off the policy's so the ratios matter."""
    gen = torch.Generator().manual_seed(seed)
    spans = [(6, False), (4, True), (5, False), (3, True), (4, False), (2, True)]
    ids, sampled, logprobs = [], [], []
    for length, is_sampled in spans:
        ids += torch.randint(0, 256, (length,), generator=gen).tolist()
        sampled += [is_sampled] * length
        lp = (-4.0 + torch.rand(length, generator=gen)).tolist()
        logprobs += lp if is_sampled else [0.0] * length
    return RolloutSample(
        tuple(ids), tuple(sampled), tuple(logprobs), reward=1.0, advantage=advantage, turns=3
    )


def pack(samples):
    return pack_rollouts(
        samples, num_rows=2, seq_len=64, micro_batch_size=2, temperature=0.8, pad_token_id=PAD
    )


def grads_and_hidden_grads(model, micro_batches, config):
    """The parameter gradients and the gradient of the final norm's output [B, T, H] (what the
    LM head reads: position p predicts token p + 1 and feeds nothing else)."""
    seen = []

    def keep(_module, _inputs, output):
        output.retain_grad()
        seen.append(output)

    hook = model.model.norm.register_forward_hook(keep)
    model.zero_grad(set_to_none=True)
    batch = RLBatch(micro_batches, num_samples=0, data_after=DataPosition())
    try:
        rl_gradients_(model, batch, one_process_runtime(), config, 8)
    finally:
        hook.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen[0].grad


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_context_tokens_inside_a_sample_get_exactly_zero_gradient(eval_model, aggregation):
    model = eval_model.train()
    samples = [multi_turn(0, 1.5), multi_turn(1, -0.5)]
    (mb,) = pack(samples)
    # Trained tokens == sampled tokens, placed where the sample has them.
    start = 0
    for sample, length in zip(samples, mb.sample_lengths[0]):
        assert mb.rows.loss_mask[0, start : start + length].tolist() == list(sample.sampled)
        start += length
    config = RLLossConfig(kind="ratio", kl_tau=0.1, aggregation=aggregation)
    grads, hidden = grads_and_hidden_grads(model, (mb,), config)
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    # Position p carries gradient exactly when token p + 1 was sampled.
    carries = hidden[0, :-1].abs().amax(-1) > 0
    assert torch.equal(carries, mb.rows.loss_mask[0, 1:])
    assert float(hidden[0, -1].abs().max()) == 0.0
    # What the batch holds at context tokens is never read: other values there, same bits.
    context = ~mb.rows.loss_mask
    noise = torch.randn(mb.advantages.shape, generator=torch.Generator().manual_seed(5))
    perturbed = dataclasses.replace(
        mb,
        advantages=torch.where(context, noise, mb.advantages),
        inference_logprobs=torch.where(context, -noise.abs(), mb.inference_logprobs),
    )
    again, _ = grads_and_hidden_grads(model, (perturbed,), config)
    for name, grad in grads.items():
        assert torch.equal(again[name], grad), name


def test_the_sequence_aggregation_counts_a_samples_sampled_tokens_only():
    samples = [multi_turn(0, 1.0), multi_turn(1, 1.0)]
    (mb,) = pack(samples)
    n = int(mb.rows.loss_mask[:, 1:].sum())
    logprobs = TokenLogprobs(logp=torch.zeros(n), entropy=torch.zeros(n))
    inputs = loss_inputs(logprobs, mb)
    assert inputs.num_samples == 2
    assert inputs.sample_token_counts().tolist() == [9.0, 9.0]
    assert [s.sampled_count for s in samples] == [9, 9]


def test_a_single_turn_sample_is_one_sampled_span_after_the_prompt():
    completion = Completion((7, 8, 2), (-0.5, -0.25, -1.0), stopped=False)
    sample = single_turn((1, 2), completion, reward=0.5, advantage=1.0)
    assert sample.token_ids == (1, 2, 7, 8, 2)
    assert sample.sampled == (False, False, True, True, True)
    assert sample.logprobs == (0.0, 0.0, -0.5, -0.25, -1.0)
    assert sample.truncated and sample.turns == 1 and sample.sampled_count == 3


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(sampled=(True, True, True)), "must start with a context token"),
        (dict(sampled=(False, False, False), logprobs=(0.0,) * 3), "no sampled token"),
        (dict(logprobs=(-1.0, -1.0, -1.0)), "logprobs on tokens it did not sample"),
        (dict(sampled=(False, True)), "3 tokens but 2 mask values"),
    ],
)
def test_a_malformed_sample_says_what_is_wrong(change, message):
    sample = RolloutSample((1, 2, 3), (False, True, True), (0.0, -1.0, -1.0), 0.0, 1.0)
    with pytest.raises(ValueError, match=message):
        pack([dataclasses.replace(sample, **change)])
