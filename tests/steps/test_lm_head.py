"""The chunked LM head (fnt/model/lm_head.py) against the full-logits path: same losses, metric sums
and gradients for SFT and RL, untied and tied heads, in one process and at 2 ranks under FSDP2; and
no [T, V] float tensor in its forward or backward."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, LlamaConfig

from fnt.batch import DataPosition, PackedRows, RLBatch, RLMicroBatch, SftBatch
from fnt.config import ParallelConfig, RLLossConfig
from fnt.config.parallel import plan_parallel_dims
from fnt.data.synthetic import take_rows
from fnt.distributed.runtime import Runtime
from fnt.model.lm_head import (
    chunked_head,
    loss_tokens_of,
    resolve_loss_kernel,
    use_loss_kernel_,
)
from fnt.optim.setup import NO_OFFLOAD
from fnt.update import accumulate_gradients_, forward_loss_tokens
from steps.rl import rl_gradients_
from steps.sft import sft_loss

V = 96
LOSS_CONFIG = RLLossConfig(eps_low=0.2, eps_high=0.28, kl_tau=0.1)
RUNTIME = Runtime(
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    device=torch.device("cpu"),
    distributed=False,
    dims=plan_parallel_dims(ParallelConfig(), 1, 1),
    mesh=None,
    num_threads=1,
    offload=NO_OFFLOAD,
)


@functools.cache
def tiny_llama(tied: bool, vocab_size: int = V) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model.train()


def packed_rows(masks: list[list[bool]], seed: int) -> PackedRows:
    """One document per row; masks[b] says which of tokens 1..T-1 of row b are loss tokens."""
    B, T = len(masks), len(masks[0]) + 1
    input_ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    loss_mask = torch.tensor([[False, *m] for m in masks])
    positions = torch.arange(T).expand(B, T).contiguous()
    return PackedRows(input_ids, positions, torch.zeros_like(input_ids), loss_mask)


def split(rows: PackedRows, size: int) -> list[PackedRows]:
    return [take_rows(rows, i, i + size) for i in range(0, rows.input_ids.shape[0], size)]


def sft_batch(rows: PackedRows, size: int) -> SftBatch:
    return SftBatch(tuple(split(rows, size)), num_samples=1, data_after=DataPosition())


def rl_batch(rows: PackedRows, size: int, seed: int) -> RLBatch:
    """Advantages in [-1, 1], temperatures in [0.5, 1.5], inference logprobs near uniform's
    (so both masking rules and the penalty take part)."""
    gen = torch.Generator().manual_seed(seed + 1)
    shape = rows.input_ids.shape
    advantages = 2 * torch.rand(shape, generator=gen) - 1
    temperatures = 0.5 + torch.rand(shape, generator=gen)
    inference = -math.log(V) + 0.3 * torch.randn(shape, generator=gen)
    micro = []
    for i, part in enumerate(split(rows, size)):
        lo, hi = i * size, i * size + part.input_ids.shape[0]
        micro.append(
            RLMicroBatch(
                part,
                advantages[lo:hi],
                temperatures[lo:hi],
                inference[lo:hi],
                tuple((shape[1],) for _ in range(hi - lo)),
            )
        )
    return RLBatch(tuple(micro), num_samples=1, data_after=DataPosition())


def gradients(model, accumulate, *args, **kwargs):
    """The totals and a copy of every parameter's gradient of `accumulate(model, *args, ...)`."""
    model.zero_grad(set_to_none=True)
    totals = accumulate(model, *args, **kwargs)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return totals, grads


def assert_within(got, want, what: str) -> None:
    """|got - want| <= 1e-6 (1 + max |want|), per tensor: equal up to float32 rounding.

    The two paths round differently (the head's matmul over the gathered rows or over all of
    them, the weight gradient summed chunk by chunk), so logp can differ in its last bit, an ulp
    of |logp| ~ log V; exp(logp - q) in the RL loss turns that into a relative ~5e-7.
    """
    tolerance = 1e-6 * (1 + float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=what)


def assert_same(chunked, full):
    """Per loss token, the same loss and metric sums; the same gradient of every parameter."""
    (c_totals, c_grads), (f_totals, f_grads) = chunked, full
    assert c_totals.loss_tokens == f_totals.loss_tokens
    n = max(f_totals.loss_tokens, 1.0)
    assert_within(c_totals.loss_sum / n, f_totals.loss_sum / n, "loss")
    assert c_totals.sums.keys() == f_totals.sums.keys()
    for key, value in f_totals.sums.items():
        assert_within(c_totals.sums[key] / n, value / n, key)
    assert c_grads.keys() == f_grads.keys()
    for name, grad in f_grads.items():
        # The loss reaches every parameter, also without loss tokens.
        assert grad is not None and c_grads[name] is not None, name
        assert_within(c_grads[name], grad, name)


masks_strategy = st.integers(2, 12).flatmap(
    lambda T: st.lists(
        st.lists(st.booleans(), min_size=T - 1, max_size=T - 1), min_size=1, max_size=4
    )
)
EMPTY_FIRST = [[False] * 6, [False] * 6, [True] * 6, [True, False] * 3]  # an all-masked mb runs
NOTHING = [[False] * 5, [False] * 5]  # no loss token at all
FULL = [[True] * 8, [True] * 8]  # 16 loss tokens: chunks of 4 and 8 divide them, 5 does not


def equivalence(test):
    examples = [(EMPTY_FIRST, 2, 3), (NOTHING, 1, 1), (FULL, 2, 4), (FULL, 2, 5), (FULL, 2, 8)]
    for masks, size, chunk in examples:
        test = example(masks=masks, size=size, chunk=chunk, seed=0)(test)
    test = given(
        masks=masks_strategy,
        size=st.integers(1, 4),
        chunk=st.integers(1, 40),
        seed=st.integers(0, 2**16),
    )(test)
    return settings(max_examples=25, deadline=None)(test)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@equivalence
def test_sft_chunked_equals_full_logits(tied, masks, size, chunk, seed):
    model, rows = tiny_llama(tied), packed_rows(masks, seed)
    batch = sft_batch(rows, size)

    def run(chunk_tokens):
        return gradients(
            model, accumulate_gradients_, batch, RUNTIME, sft_loss, chunk_tokens=chunk_tokens
        )

    assert_same(run(chunk), run(0))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@equivalence
def test_rl_chunked_equals_full_logits(tied, masks, size, chunk, seed):
    model, rows = tiny_llama(tied), packed_rows(masks, seed)
    batch = rl_batch(rows, size, seed)

    def run(chunk_tokens):
        return gradients(model, rl_gradients_, batch, RUNTIME, LOSS_CONFIG, chunk_tokens)

    chunked, full = run(chunk), run(0)
    assert_same(chunked, full)
    assert set(full[0].sums) >= {"entropy", "masked_high", "masked_low", "mismatch_kl"}


@pytest.mark.parametrize("chunk", [0, 3])
def test_the_zero_surrogate_reaches_every_parameter_without_loss_tokens(chunk):
    """What a non-finite micro-batch back-propagates under FSDP2 touches every parameter."""
    model = tiny_llama(tied=False)
    rows = packed_rows(NOTHING, seed=0)
    model.zero_grad(set_to_none=True)
    head_out, logprobs = forward_loss_tokens(model, rows, loss_tokens_of(rows), chunk)
    assert logprobs.logp.shape == (0,)
    (head_out.sum() * 0.0).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_the_head_gets_its_forward_back_also_on_error():
    model = tiny_llama(tied=False)
    rows = packed_rows(FULL, seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        with chunked_head(model, loss_tokens_of(rows), 4):
            assert "forward" in vars(model.lm_head)
            raise RuntimeError("boom")
    assert "forward" not in vars(model.lm_head)
    assert model.lm_head(torch.zeros(1, 16)).shape == (1, V)


class LargestFloatTensor(TorchDispatchMode):
    """Records the element count of the largest floating-point tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("step", ["sft", "rl"])
def test_no_tensor_of_all_the_logits_exists_in_forward_or_backward(step):
    big_v, T, chunk = 4096, 256, 32
    model = tiny_llama(tied=True, vocab_size=big_v)
    rows = packed_rows([[True] * (T - 1)], seed=0)

    def largest(chunk_tokens):
        model.zero_grad(set_to_none=True)
        with LargestFloatTensor() as mode:
            if step == "sft":
                accumulate_gradients_(
                    model, sft_batch(rows, 1), RUNTIME, sft_loss, chunk_tokens=chunk_tokens
                )
            else:
                rl_gradients_(model, rl_batch(rows, 1, 0), RUNTIME, LOSS_CONFIG, chunk_tokens)
        assert "aten.embedding_dense_backward.default" in mode.ops  # the backward was seen
        return mode.largest

    assert largest(0) >= (T - 1) * big_v  # the check can fail: the full path holds [T, V]
    assert largest(chunk) <= chunk * big_v < T * big_v


def lm_head_job(fixture, out):
    models = [str(fixture("tiny_model_dir")), str(fixture("tiny_tied_dir"))]
    return {"call": "tests.steps.lm_head_loop:main", "args": [str(out), *models]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=lm_head_job)
def test_chunked_equals_full_logits_at_two_ranks(two_rank_runs):
    out = two_rank_runs(lm_head_job)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    cases = {(c["model"], c["loss"], c["poisoned"]) for c in results[0]["cases"]}
    assert len(cases) == 2 * 2 * 2
    for result in results:
        for case in result["cases"]:
            assert case["loss_tokens"] > 0
            assert case["nan_count"] == (1.0 if case["poisoned"] else 0.0)
            assert math.isfinite(case["loss_sum"]) and math.isfinite(case["grad_norm"])
            assert case["loss_sum_diff"] <= 1e-6 * max(1.0, abs(case["loss_sum"])), case
            assert case["sums_max_diff"] <= 1e-6 * max(1.0, case["sums_max"]), case
            assert case["grad_norm_diff"] <= 1e-6, case
            assert case["grad_max_diff"] <= 1e-6, case


@pytest.mark.numerics
def test_the_compiled_loss_kernel_equals_the_eager_one():
    """model.loss_kernel = "compiled" (one torch.compile graph per chunk, plain ops whose
    backward autograd derives) against the eager chunks: the same loss, metric sums and
    gradients within float32 rounding, SFT and RL (temperatures and entropies), with chunks of
    several sizes (the last one shorter)."""
    model, rows = tiny_llama(tied=True), packed_rows(FULL, seed=3)

    def run(kernel, accumulate, *args, **kwargs):
        use_loss_kernel_(model, kernel)
        return gradients(model, accumulate, *args, **kwargs)

    for accumulate, args, kwargs in (
        (accumulate_gradients_, (sft_batch(rows, 2), RUNTIME, sft_loss), {"chunk_tokens": 5}),
        (rl_gradients_, (rl_batch(rows, 2, 3), RUNTIME, LOSS_CONFIG, 5), {}),
    ):
        compiled = run("compiled", accumulate, *args, **kwargs)
        eager = run("eager", accumulate, *args, **kwargs)
        assert_same(compiled, eager)
    assert resolve_loss_kernel("auto", "cpu") == "eager"
    assert resolve_loss_kernel("compiled", "cpu") == "compiled"
