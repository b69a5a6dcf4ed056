"""Log-probabilities of the loss tokens, from the final hidden states and the LM head in chunks.
Pure, except `chunked_head`, which replaces the LM head's forward inside its block.

The full logits of a micro-batch are [B, T, V]: at Qwen3's vocabulary (151,936) one float32 copy
is 0.6 GB per 1k tokens, and a forward and backward through them hold several copies. A loss
reads the logits only at its loss tokens (in RL the prompt is often most of a row), so the
chunked head first gathers the hidden states of the positions that predict a loss token, then
computes the logits of `chunk` of those positions at a time. Every chunk but the last is
checkpointed: its logits are freed after its forward and recomputed in backward, so no more than
[chunk, V] of them exist at once. The last chunk keeps what its backward needs, because its
backward runs first, right after the forward; that costs no extra peak and saves recomputing it
(with a single chunk, nothing is recomputed at all).

Why inside the model's forward: under FSDP2 the root unit owns the LM head (and the embedding,
which a tied head shares), and its parameters are unsharded only while the root's forward runs;
the root's hooks regather them for backward and reduce-scatter their gradients. `chunked_head`
therefore swaps the head's forward for one that computes the statistics from the hidden states it
receives and the then unsharded weight. Hugging Face causal LMs return whatever the head returns
as `.logits` (transformers 5: `logits = self.lm_head(slice_logits_to_keep(hidden_states,
logits_to_keep))` in LlamaForCausalLM and Qwen3MoeForCausalLM; fnt passes no `logits_to_keep`,
whose default 0 keeps every position). A tied head's weight is the embedding's parameter, so the
gradients of both uses accumulate into it.

Nucleus (top-p) sampling: a token sampled from the nucleus of p (rollout.vllm.top_p < 1) has
the probability of the truncated distribution, softmax over the kept tokens only, which is what
vLLM returns for it (--logprobs-mode processed_logprobs). So the trainer computes the same:
with a top-p below 1 on a loss token, its logprob is z[target] - logsumexp(z over the kept set),
z = logits / temperature, the kept set found from the trainer's own z exactly as vLLM's PyTorch
sampler finds it (`nucleus_mask`), and held constant for the gradient (it is piecewise constant
in z). Its entropy is that of the truncated distribution, the one sampled from. A top-p of 1
(the in-process engine's, external samples') leaves the full softmax, bit for bit as before.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from fnt.batch import PackedRows, row_layout


@dataclass(frozen=True)
class LossTokens:
    """The N loss tokens of a micro-batch, row-major (the order of `t[:, 1:][mask]`)."""

    mask: Tensor  # [B, T - 1] bool, loss_mask[:, 1:]: the logits at t predict loss token t + 1
    # [N] int64, the flat positions b * T + t of those logits in [B * T]. index_select with it
    # back-propagates with index_add, which is far faster than a boolean mask's index_put.
    index: Tensor
    targets: Tensor  # [N] int64, the loss tokens
    temperatures: Optional[Tensor]  # [N] float32 (> 0), the softmax temperatures; None means 1
    entropy: bool  # also compute each token's softmax entropy (without gradient)
    # [N] float32 in (0, 1], the nucleus (top-p) each token was sampled from; None means 1
    top_ps: Optional[Tensor] = None


def at_loss_tokens(rows: PackedRows, per_token: Tensor) -> Tensor:
    """The values [N] of a per-token tensor [B, T] (token t's at t) at the rows' loss tokens:
    `per_token[:, 1:][loss_mask[:, 1:]]`, taken by the host layout's index (a boolean mask
    would read its count back from the device)."""
    return per_token.flatten().index_select(0, row_layout(rows).loss_index + 1)


def loss_tokens_of(
    rows: PackedRows,
    temperatures: Optional[Tensor] = None,
    entropy: bool = False,
    top_ps: Optional[Tensor] = None,
) -> LossTokens:
    """The loss tokens of `rows`; `temperatures` [B, T] holds token t's temperature at t, and
    `top_ps` [B, T] its nucleus (top-p). The positions come from the rows' host layout
    (fnt.batch.row_layout), so nothing is read back."""

    def at_tokens(per_token: Optional[Tensor]) -> Optional[Tensor]:
        return None if per_token is None else at_loss_tokens(rows, per_token).float()

    return LossTokens(
        mask=rows.loss_mask[:, 1:],
        index=row_layout(rows).loss_index,
        targets=at_loss_tokens(rows, rows.input_ids),
        temperatures=at_tokens(temperatures),
        entropy=entropy,
        top_ps=at_tokens(top_ps),
    )


@dataclass(frozen=True)
class TokenLogprobs:
    """What a loss sees of the model: one value per loss token, in LossTokens order."""

    # [N] float32, differentiable: log_softmax(logits / temperature)[target], over the nucleus
    # when the token has a top-p below 1 (module docstring)
    logp: Tensor
    entropy: Optional[Tensor]  # [N] float32, no gradient: the entropy of that softmax, if asked


class _TargetLogprob(torch.autograd.Function):
    """(z[target] - logsumexp(z), logsumexp(z)) of rows z [n, V], differentiable in the first.

    The values and gradients are bit for bit those of autograd through the same two ops; the
    backward, -g softmax(z) + g onehot(target), makes one [n, V] tensor where autograd makes
    three (the gather's zeros, softmax times g, their sum), in about a third of the time.
    """

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ctx.save_for_backward(z, lse, targets)
        ctx.mark_non_differentiable(lse)
        return logp, lse

    @staticmethod
    def backward(ctx, grad: Tensor, _: Tensor) -> tuple[Tensor, None]:
        z, lse, targets = ctx.saved_tensors
        grad_z = (z - lse[:, None]).exp_().mul_(-grad[:, None])
        return grad_z.scatter_add_(-1, targets[:, None], grad[:, None]), None


NUCLEUS_ROWS = 128
"""Rows whose nucleus `nucleus_mask` finds at once: sorting a row makes several tensors of its
size (the sorted values, their int64 indices, the cumulative probabilities, the mask), so a
chunk of model.loss_chunk_tokens rows is done this many at a time."""


@torch.compiler.disable  # eager also inside the compiled kernel: one implementation of the rule
@torch.no_grad()
def nucleus_mask(z: Tensor, top_ps: Tensor, targets: Tensor) -> Tensor:
    """[n, V] bool: the tokens nucleus sampling with top-p `top_ps` [n] keeps from softmax(z)
    of rows z [n, V] (float32), each row's target always among them; all of a row whose top-p
    is 1 or more.

    vLLM's rule (vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch, the sampler
    of its CPU build and of GPUs without Triton): sort the row ascending, take the cumulative
    sum of the sorted probabilities in float32, drop the tokens whose cumulative sum is <= 1 - p
    and never the most probable one. So a token is kept when less than p of the probability
    lies on the tokens sorted above it: the token that crosses p is kept. Of tokens tied at the
    boundary, those the sort puts higher are kept: the same call as vLLM's (torch's default,
    not stable) sorts the same row the same way on the same device type and torch build, so the
    ties go as vLLM's do (a short row keeps vocabulary order: the later tokens are kept). vLLM's
    Triton kernel (GPUs) keeps the same set up to float rounding and which of such ties it keeps.

    The target is kept also where the trainer's set misses it: the sampler kept it, and the two
    sets differ only at their boundary (by rounding, or where the policy moved since it sampled,
    rollout.async_level); without it the logprob would be -inf and the micro-batch's loss
    non-finite."""
    kept = torch.empty(z.shape, dtype=torch.bool, device=z.device)
    for start in range(0, z.shape[0], NUCLEUS_ROWS):
        rows = slice(start, start + NUCLEUS_ROWS)
        ascending, order = z[rows].sort(dim=-1)  # vLLM's call, so ties go as its do
        mass_so_far = ascending.softmax(dim=-1).cumsum_(dim=-1)
        dropped = mass_so_far <= (1 - top_ps[rows])[:, None]
        dropped[:, -1] = False
        kept[rows].scatter_(-1, order, ~dropped)
    kept.scatter_(-1, targets[:, None], True)
    return kept.logical_or_((top_ps >= 1)[:, None])


def truncated_logits(
    logits: Tensor, targets: Tensor, temperatures: Optional[Tensor], top_ps: Optional[Tensor]
) -> tuple[Tensor, Optional[Tensor]]:
    """(z, kept): z = logits / temperature in float32, -inf outside each row's nucleus (module
    docstring), and the [n, V] mask of the kept tokens (None without `top_ps`: all kept)."""
    z = logits.float()
    if temperatures is not None:
        z = z / temperatures[:, None]
    if top_ps is None:
        return z, None
    kept = nucleus_mask(z.detach(), top_ps, targets)
    return z.masked_fill(~kept, -math.inf), kept


def _expected_logit(z: Tensor, kept: Optional[Tensor]) -> Tensor:
    """sum of softmax(z) * z per row: the entropy is logsumexp(z) minus it. Outside the kept
    set z is -inf and its probability 0, so those terms are 0 (not 0 * -inf)."""
    finite = z if kept is None else z.masked_fill(~kept, 0.0)
    return torch.softmax(z, dim=-1).mul_(finite).sum(dim=-1)


def token_stats(
    logits: Tensor,
    targets: Tensor,
    temperatures: Optional[Tensor],
    entropy: bool,
    top_ps: Optional[Tensor] = None,
) -> Tensor:
    """[1, n] logp, or [2, n] (logp, entropy), of n tokens from their logits [n, V], in float32,
    over each token's nucleus when `top_ps` gives one below 1."""
    z, kept = truncated_logits(logits, targets, temperatures, top_ps)
    logp, lse = _TargetLogprob.apply(z, targets)
    if not entropy:
        return logp[None]
    with torch.no_grad():
        ent = lse - _expected_logit(z, kept)
    return torch.stack([logp, ent])


def _head_stats(hidden, weight, bias, targets, temperatures, entropy, top_ps) -> Tensor:
    return token_stats(F.linear(hidden, weight, bias), targets, temperatures, entropy, top_ps)


def _plain_head_stats(hidden, weight, bias, targets, temperatures, entropy, top_ps) -> Tensor:
    """`_head_stats` in plain ops, for torch.compile: autograd derives the backward and the
    compiler fuses the cast, the logsumexp, the gather and their backward into few kernels."""
    z, kept = truncated_logits(F.linear(hidden, weight, bias), targets, temperatures, top_ps)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp[None]
    finite = z if kept is None else z.masked_fill(~kept, 0.0)
    ent = (lse - torch.softmax(z, dim=-1).mul(finite).sum(dim=-1)).detach()
    return torch.stack([logp, ent])


@functools.cache
def compiled_head_stats() -> Callable[..., Tensor]:
    """The compiled chunk of model.loss_kernel = "compiled" (one graph for every chunk size)."""
    return torch.compile(_plain_head_stats, dynamic=True)


AUTO_LOSS_KERNEL: dict[str, str] = {}
"""What model.loss_kernel = "auto" means per device type, where it is not "eager": a device
type gets "compiled" once the GPU check (scripts/bench_loss.py --kernels) has measured it
faster there; none has been yet."""


def resolve_loss_kernel(setting: str, device_type: str) -> str:
    """The loss kernel model.loss_kernel = `setting` means on `device_type`. Pure."""
    return AUTO_LOSS_KERNEL.get(device_type, "eager") if setting == "auto" else setting


def use_loss_kernel_(model: nn.Module, kernel: str) -> None:
    """Make the model's chunked head compute each chunk with `kernel` ("eager" or "compiled")."""
    model.get_output_embeddings()._fnt_loss_kernel = kernel


def chunked_token_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    tokens: LossTokens,
    chunk: int,
    kernel: str = "eager",
) -> Tensor:
    """`token_stats` of the loss tokens from the hidden states [B, T, H] of every position and
    the head's weight [V, H] (and bias), `chunk` tokens at a time (see the module docstring),
    each chunk by `kernel` ("eager", or "compiled": `compiled_head_stats`)."""
    if chunk < 1:
        raise ValueError(f"the chunk size must be at least 1 loss token, got {chunk}")
    if hidden.shape[:2] != (tokens.mask.shape[0], tokens.mask.shape[1] + 1):
        raise ValueError(
            f"the chunked head needs the hidden states of every position, got {tuple(hidden.shape)}"
        )
    head_stats = compiled_head_stats() if kernel == "compiled" else _head_stats
    selected = hidden.flatten(0, 1).index_select(0, tokens.index)
    n = selected.shape[0]
    parts = []
    # At least one (possibly empty) chunk, so that a micro-batch without loss tokens still has a
    # graph through the head and the whole model, as the full-logits path has.
    for start in range(0, max(n, 1), chunk):
        part = slice(start, start + chunk)
        temperatures = None if tokens.temperatures is None else tokens.temperatures[part]
        top_ps = None if tokens.top_ps is None else tokens.top_ps[part]
        args = (
            *(selected[part], weight, bias, tokens.targets[part]),
            *(temperatures, tokens.entropy, top_ps),
        )
        if start + chunk >= n:
            parts.append(head_stats(*args))
        else:
            # No randomness inside, so the RNG state need not be saved and restored.
            stats = checkpoint(head_stats, *args, use_reentrant=False, preserve_rng_state=False)
            parts.append(stats)
    return torch.cat(parts, dim=1)


def logprobs_of(stats: Tensor, tokens: LossTokens) -> TokenLogprobs:
    """The TokenLogprobs held in `token_stats`' output."""
    return TokenLogprobs(logp=stats[0], entropy=stats[1].detach() if tokens.entropy else None)


def logprobs_from_logits(logits: Tensor, tokens: LossTokens) -> TokenLogprobs:
    """The TokenLogprobs of the loss tokens from the full logits [B, T, V] (the unchunked path)."""
    selected = logits.flatten(0, 1).index_select(0, tokens.index)
    stats = token_stats(
        selected, tokens.targets, tokens.temperatures, tokens.entropy, tokens.top_ps
    )
    return logprobs_of(stats, tokens)


@contextlib.contextmanager
def chunked_head(model: nn.Module, tokens: LossTokens, chunk: int) -> Iterator[None]:
    """Inside the block, the model's LM head returns `chunked_token_stats` of `tokens` instead of
    logits, so `model(...).logits` is a [1 or 2, N] tensor. The head's own forward comes back
    on exit, also on error."""
    head = model.get_output_embeddings()
    previous = head.__dict__.get("forward")
    kernel = getattr(head, "_fnt_loss_kernel", "eager")

    def forward(hidden: Tensor) -> Tensor:
        # Read the parameters at call time: under FSDP2 they are the unsharded ones only now.
        return chunked_token_stats(hidden, head.weight, head.bias, tokens, chunk, kernel)

    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
