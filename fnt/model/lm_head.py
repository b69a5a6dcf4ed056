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
"""

from __future__ import annotations

import contextlib
import functools
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


def at_loss_tokens(rows: PackedRows, per_token: Tensor) -> Tensor:
    """The values [N] of a per-token tensor [B, T] (token t's at t) at the rows' loss tokens:
    `per_token[:, 1:][loss_mask[:, 1:]]`, taken by the host layout's index (a boolean mask
    would read its count back from the device)."""
    return per_token.flatten().index_select(0, row_layout(rows).loss_index + 1)


def loss_tokens_of(
    rows: PackedRows, temperatures: Optional[Tensor] = None, entropy: bool = False
) -> LossTokens:
    """The loss tokens of `rows`; `temperatures` [B, T] holds token t's temperature at t. The
    positions come from the rows' host layout (fnt.batch.row_layout), so nothing is read back."""
    return LossTokens(
        mask=rows.loss_mask[:, 1:],
        index=row_layout(rows).loss_index,
        targets=at_loss_tokens(rows, rows.input_ids),
        temperatures=None if temperatures is None else at_loss_tokens(rows, temperatures).float(),
        entropy=entropy,
    )


@dataclass(frozen=True)
class TokenLogprobs:
    """What a loss sees of the model: one value per loss token, in LossTokens order."""

    logp: Tensor  # [N] float32, differentiable: log_softmax(logits / temperature)[target]
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


def token_stats(
    logits: Tensor, targets: Tensor, temperatures: Optional[Tensor], entropy: bool
) -> Tensor:
    """[1, n] logp, or [2, n] (logp, entropy), of n tokens from their logits [n, V], in float32."""
    z = logits.float()
    if temperatures is not None:
        z = z / temperatures[:, None]
    logp, lse = _TargetLogprob.apply(z, targets)
    if not entropy:
        return logp[None]
    with torch.no_grad():
        ent = lse - torch.softmax(z, dim=-1).mul_(z).sum(dim=-1)
    return torch.stack([logp, ent])


def _head_stats(hidden, weight, bias, targets, temperatures, entropy) -> Tensor:
    return token_stats(F.linear(hidden, weight, bias), targets, temperatures, entropy)


def _plain_head_stats(hidden, weight, bias, targets, temperatures, entropy) -> Tensor:
    """`_head_stats` in plain ops, for torch.compile: autograd derives the backward and the
    compiler fuses the cast, the logsumexp, the gather and their backward into few kernels."""
    z = F.linear(hidden, weight, bias).float()
    if temperatures is not None:
        z = z / temperatures[:, None]
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp[None]
    ent = (lse - torch.softmax(z, dim=-1).mul(z).sum(dim=-1)).detach()
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
        args = (selected[part], weight, bias, tokens.targets[part], temperatures, tokens.entropy)
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
    stats = token_stats(selected, tokens.targets, tokens.temperatures, tokens.entropy)
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
