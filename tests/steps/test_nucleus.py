"""The trainer's logprobs under nucleus (top-p) sampling (fnt/model/lm_head.py): the kept set is
vLLM's, checked against a float64 reference of the rule on hand-made logits (the crossing
token, ties, a top-p of 1, a target outside the set) and on random ones; logprobs, entropies and
gradients against float64 autograd over that set; a top-p of 1 bit for bit the full softmax;
the chunked, full-logits and compiled heads alike; and in the RL step the sampler's truncated
logprobs meet the trainer's (no mismatch), which the full softmax's would not. The real
server's test is tests/e2e/test_vllm.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fnt.batch import RLMicroBatch
from fnt.model.lm_head import (
    NUCLEUS_ROWS,
    loss_tokens_of,
    nucleus_mask,
    token_stats,
    use_loss_kernel_,
)
from fnt.rollout.engines.vllm import with_top_p
from fnt.update import forward_loss_tokens
from steps.rl import reference_logprobs, rl_gradients_, rl_metrics

from .test_lm_head import (
    FULL,
    LOSS_CONFIG,
    RUNTIME,
    V,
    assert_same,
    gradients,
    packed_rows,
    rl_batch,
    tiny_llama,
)


def reference_nucleus(logits: list[float], top_p: float, target: int) -> set[int]:
    """The kept tokens in float64, the rule read the other way round from vLLM's ascending
    cumulative sum: rank the tokens by probability, the later index first among equals (where
    torch's sort keeps vocabulary order, as in a short row, vLLM's ascending sort puts the
    earlier one lower), and keep a token while less than top_p of the probability lies on the
    tokens ranked before it; the target always. Ties in long rows: tests/e2e/test_vllm_nucleus.py
    compares with vLLM's own function."""
    if top_p >= 1:
        return set(range(len(logits)))
    probs = torch.tensor(logits, dtype=torch.float64).softmax(-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: (probs[i], i), reverse=True)
    kept, before = {target}, 0.0
    for i in ranked:
        if before < top_p:
            kept.add(i)
        before += probs[i]
    return kept


def kept_set(logits: list[float], top_p: float, target: int = 0) -> set[int]:
    z = torch.tensor([logits], dtype=torch.float32)
    mask = nucleus_mask(z, torch.tensor([top_p]), torch.tensor([target]))
    return set(torch.nonzero(mask[0]).flatten().tolist())


# Probabilities about 0.53, 0.20, 0.20, 0.07: tokens 1 and 2 tie.
TIED = [2.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "logits, top_p, target, kept",
    [
        # 0.6 + 0.35 crosses 0.9 at token 1, which is kept; token 2 is not.
        ([math.log(0.6), math.log(0.35), math.log(0.05)], 0.9, 0, {0, 1}),
        # The most probable token alone already holds more than top_p: it is kept, alone.
        ([math.log(0.6), math.log(0.35), math.log(0.05)], 0.5, 0, {0}),
        # A tie across the boundary: of tokens 1 and 2 the later one is kept (0.53 < 0.6 lie
        # before it), the earlier not (0.73 do).
        (TIED, 0.6, 0, {0, 2}),
        # The whole tie inside: 0.93 > 0.75 after both.
        (TIED, 0.75, 0, {0, 1, 2}),
        # A target outside the set is kept all the same (the sampler kept it).
        (TIED, 0.6, 3, {0, 2, 3}),
        # top_p = 1 keeps every token, also those whose float32 probability is exactly 0.
        ([0.0, 1.0, -200.0], 1.0, 0, {0, 1, 2}),
    ],
)
def test_the_kept_set_is_vllms(logits, top_p, target, kept):
    assert reference_nucleus(logits, top_p, target) == kept
    assert kept_set(logits, top_p, target) == kept


@pytest.mark.numerics
def test_the_kept_set_of_random_rows_matches_the_reference():
    """Rows of random logits (more than NUCLEUS_ROWS, so the mask is built in parts), each with
    a top-p halfway between two cumulative sums of its sorted probabilities, where float32 and
    float64 agree on which tokens come before it."""
    gen = torch.Generator().manual_seed(0)
    n = NUCLEUS_ROWS + 37
    z = 3.0 * torch.randn(n, V, generator=gen)
    targets = torch.randint(0, V, (n,), generator=gen)
    probs, order = z.double().softmax(-1).sort(-1, descending=True)
    cum = probs.cumsum(-1)  # cum[j]: the mass of the j + 1 most probable tokens
    k = torch.randint(0, 20, (n,), generator=gen)
    top_ps = ((cum.gather(1, k[:, None]) + cum.gather(1, k[:, None] + 1)) / 2).squeeze(1).float()
    top_ps[::7] = 1.0
    mask = nucleus_mask(z, top_ps, targets)
    for row in range(n):
        target = int(targets[row])
        want = reference_nucleus(z[row].tolist(), float(top_ps[row]), target)
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == want, row
        if top_ps[row] < 1:  # less than top_p lies before each of the k + 2 most probable
            assert want == set(order[row, : int(k[row]) + 2].tolist()) | {target}


def reference_stats(logits, targets, temperatures, top_ps):
    """float64: (logp of each target over its reference nucleus at its temperature, entropy of
    that truncated distribution, d sum(logp * weights) / d logits) with the set held fixed."""
    z = logits.detach().double().requires_grad_(True)
    scaled = z / temperatures.double()[:, None]
    keep = torch.zeros(scaled.shape, dtype=torch.bool)
    for row in range(scaled.shape[0]):
        for i in reference_nucleus(scaled[row].tolist(), float(top_ps[row]), int(targets[row])):
            keep[row, i] = True
    logq = scaled.masked_fill(~keep, -math.inf).log_softmax(-1)
    logp = logq.gather(1, targets[:, None]).squeeze(1)
    probs = logq.exp()
    entropy = -(probs * logq.masked_fill(~keep, 0.0)).sum(-1)
    weights = torch.linspace(-1, 1, len(targets), dtype=torch.float64)
    (logp * weights).sum().backward()
    return logp.detach(), entropy.detach(), z.grad


def random_case(n=9, vocab=V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    temperatures = 0.5 + torch.rand(n, generator=gen)
    top_ps = torch.tensor([0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0, 0.6])[:n]
    return logits, targets, temperatures, top_ps


@pytest.mark.numerics
def test_logprobs_entropies_and_gradients_match_float64_autograd_over_the_nucleus():
    logits, targets, temperatures, top_ps = random_case()
    want_logp, want_entropy, want_grad = reference_stats(logits, targets, temperatures, top_ps)
    x = logits.clone().requires_grad_(True)
    stats = token_stats(x, targets, temperatures, True, top_ps)
    weights = torch.linspace(-1, 1, len(targets))
    (stats[0] * weights).sum().backward()
    torch.testing.assert_close(stats[0].double(), want_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(stats[1].double(), want_entropy, rtol=0, atol=2e-6)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=2e-6)
    # Truncation matters here: over the whole vocabulary each truncated row's logp is lower.
    full = token_stats(logits, targets, temperatures, True)
    assert (full[0][top_ps < 1] < stats[0][top_ps < 1] - 1e-3).all()
    assert torch.equal(full[:, top_ps == 1], stats[:, top_ps == 1])


@pytest.mark.numerics
def test_a_top_p_of_1_is_bit_for_bit_the_full_softmax():
    """Rows with top-p 1 give exactly what no top-p gives, values and gradients, also next to
    truncated rows in the same call."""
    logits, targets, temperatures, _ = random_case()

    def run(top_ps):
        x = logits.clone().requires_grad_(True)
        stats = token_stats(x, targets, temperatures, True, top_ps)
        stats[0].sum().backward()
        return stats.detach(), x.grad

    plain_stats, plain_grad = run(None)
    ones_stats, ones_grad = run(torch.ones(len(targets)))
    assert torch.equal(ones_stats, plain_stats) and torch.equal(ones_grad, plain_grad)
    mixed = torch.ones(len(targets))
    mixed[::2] = 0.5
    mixed_stats, mixed_grad = run(mixed)
    assert torch.equal(mixed_stats[:, 1::2], plain_stats[:, 1::2])
    assert torch.equal(mixed_grad[1::2], plain_grad[1::2])
    assert not torch.equal(mixed_stats[:, ::2], plain_stats[:, ::2])


def with_top_ps(batch, top_ps_of_shape):
    micro = tuple(
        dataclasses.replace(mb, top_ps=top_ps_of_shape(mb.temperatures.shape))
        for mb in batch.micro_batches
    )
    return dataclasses.replace(batch, micro_batches=micro)


def random_top_ps(shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    top_ps = 0.3 + 0.7 * torch.rand(shape, generator=gen)
    top_ps[:, ::3] = 1.0
    return top_ps


@pytest.mark.numerics
def test_the_rl_step_with_top_p_1_is_bit_for_bit_the_step_without():
    model, rows = tiny_llama(tied=False), packed_rows(FULL, seed=5)
    batch = rl_batch(rows, 2, seed=5)
    assert with_top_p(batch, 1.0) is batch  # what the vLLM engine does at rollout.vllm.top_p = 1
    ones = with_top_ps(batch, torch.ones)

    def run(b):
        return gradients(model, rl_gradients_, b, RUNTIME, LOSS_CONFIG, 4)

    (plain, plain_grads), (got, got_grads) = run(batch), run(ones)
    assert torch.equal(got.loss_sum, plain.loss_sum)
    assert all(torch.equal(got.sums[k], v) for k, v in plain.sums.items())
    assert all(torch.equal(got_grads[k], g) for k, g in plain_grads.items())


@pytest.mark.numerics
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [3, 16])
def test_chunked_and_full_logits_agree_over_the_nucleus(tied, chunk):
    model, rows = tiny_llama(tied), packed_rows(FULL, seed=7)
    batch = with_top_ps(rl_batch(rows, 2, seed=7), random_top_ps)

    def run(chunk_tokens):
        return gradients(model, rl_gradients_, batch, RUNTIME, LOSS_CONFIG, chunk_tokens)

    assert_same(run(chunk), run(0))


@pytest.mark.numerics
def test_the_compiled_kernel_agrees_over_the_nucleus():
    model, rows = tiny_llama(tied=True), packed_rows(FULL, seed=3)
    batch = with_top_ps(rl_batch(rows, 2, seed=3), random_top_ps)

    def run(kernel):
        use_loss_kernel_(model, kernel)
        try:
            return gradients(model, rl_gradients_, batch, RUNTIME, LOSS_CONFIG, 5)
        finally:
            use_loss_kernel_(model, "eager")

    assert_same(run("compiled"), run("eager"))


def sampler_logprobs(model, mb: RLMicroBatch) -> torch.Tensor:
    """[B, T]: what a sampler of top-p mb.top_ps returns for each loss token (vLLM's
    processed logprobs): the float64 reference over its nucleus, from the trainer's logits."""
    tokens = loss_tokens_of(mb.rows, mb.temperatures, top_ps=mb.top_ps)
    with torch.no_grad():
        logits, _ = forward_loss_tokens(model, mb.rows, tokens, 0)
    selected = logits.flatten(0, 1).index_select(0, tokens.index)
    logp, _, _ = reference_stats(selected, tokens.targets, tokens.temperatures, tokens.top_ps)
    out = torch.zeros(mb.rows.input_ids.shape)
    out.view(-1).index_copy_(0, tokens.index + 1, logp.float())
    return out


@pytest.mark.numerics
def test_the_step_compares_the_samplers_truncated_logprobs_with_like():
    """The RL step's sampler/trainer mismatch over the nucleus: none when the sampler's logprobs
    are the truncated ones (what vLLM returns) and the micro-batches carry the top-p; large
    when the trainer would compare them with the full softmax instead."""
    model, rows = tiny_llama(tied=False), packed_rows([[True] * 8], seed=11)
    batch = with_top_ps(rl_batch(rows, 1, seed=11), lambda shape: torch.full(shape, 0.6))
    sampled = dataclasses.replace(
        batch,
        micro_batches=tuple(
            dataclasses.replace(mb, inference_logprobs=sampler_logprobs(model, mb))
            for mb in batch.micro_batches
        ),
    )

    def mismatch(b):
        totals, _ = gradients(model, rl_gradients_, b, RUNTIME, LOSS_CONFIG, 4)
        return float(rl_metrics(totals, with_inference=True)["mismatch_kl/all/mean"])

    assert mismatch(sampled) < 1e-10
    untruncated = with_top_ps(sampled, lambda shape: None)  # the trainer's full softmax
    assert mismatch(untruncated) > 1e-2


def test_the_reference_models_logprobs_stay_over_the_whole_vocabulary():
    """loss.ref_kl_tau's reference logprobs ignore the top-p: KL(sampling policy || reference)
    stays finite wherever the reference's own nucleus would not hold the sampled token."""
    model, rows = tiny_llama(tied=False), packed_rows(FULL, seed=2)
    batch = rl_batch(rows, 2, seed=2)
    truncated = with_top_ps(batch, lambda shape: torch.full(shape, 0.3))
    plain = reference_logprobs(model, batch, RUNTIME, 4)
    got = reference_logprobs(model, truncated, RUNTIME, 4)
    for a, b, mb in zip(got.micro_batches, plain.micro_batches, batch.micro_batches):
        assert torch.equal(a.ref_logprobs, b.ref_logprobs)
        tokens = loss_tokens_of(mb.rows, mb.temperatures)
        _, full = forward_loss_tokens(model, mb.rows, tokens, 0)
        torch.testing.assert_close(
            a.ref_logprobs.view(-1)[tokens.index + 1], full.logp.detach(), rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan")])
def test_a_micro_batch_with_a_top_p_outside_0_1_is_refused(value):
    mb = rl_batch(packed_rows(FULL, seed=0), 2, seed=0).micro_batches[0]
    bad = dataclasses.replace(mb, top_ps=torch.full(mb.temperatures.shape, value))
    with pytest.raises(ValueError, match=r"top_ps must be in \(0, 1\] on loss tokens"):
        bad.check()
    dataclasses.replace(mb, top_ps=torch.full(mb.temperatures.shape, 0.5)).check()


def test_an_rl_step_over_the_nucleus_reads_nothing_back(tiny_model_dir):
    """Finding the nucleus adds no read of the device (tests/steps/test_host_reads.py)."""
    from steps.rl import rl_step
    from tests.steps import test_rl_step as rl
    from tests.steps.test_host_reads import step_reads

    state = rl.make_state(tiny_model_dir)
    rows = rl.random_rows(0)
    batch = rl.rl_batch(rows, rl.own_logprobs(state.handles.model, rows))
    batch = with_top_ps(batch, lambda shape: torch.full(shape, 0.7))
    assert step_reads(rl_step, state, batch) == {}
