"""The parts of an optimizer step that SFT and RL share (and a research step of your own can
use: both are public). Side effects: collectives, grads, params.

A step function hands its per-micro-batch loss to `accumulate_gradients_`, then calls
`complete_step_` once: the optimizer update (`optimizer_update_`), the step's metrics and the
successor state. Both SFT and RL normalize by the GLOBAL number of loss tokens of the step (all
micro-batches, all ranks; `step_counts`), so k micro-batches or n ranks give the gradient of one
big batch. A loss sees the model only through the log-probabilities of its loss tokens, which the LM
head computes in chunks without ever holding the full logits (fnt/model/lm_head.py).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fnt.batch import PackedRows, row_layout, to_device
from fnt.config import ModelConfig
from fnt.distributed.collectives import all_reduce_max, all_reduce_sum, all_reduce_sums
from fnt.distributed.runtime import Runtime
from fnt.model.attention import packed_inputs
from fnt.model.lm_head import (
    LossTokens,
    TokenLogprobs,
    chunked_head,
    logprobs_from_logits,
    logprobs_of,
    loss_tokens_of,
)
from fnt.model.moe import moe_metrics, moe_top_k, record_router_logits, router_stats
from fnt.obs.metrics import Elapsed, merge_metrics
from fnt.optim import set_lr_

if TYPE_CHECKING:
    from fnt.state import TrainState
from fnt.schedule import lr_at

# (the log-probabilities of the micro-batch's N loss tokens, the micro-batch on the device) ->
# (sum of the per-token loss over the loss tokens, extra metric sums). The loss sum must be a
# differentiable scalar that depends on the model only through TokenLogprobs.logp [N]; the sums
# are detached scalars. TokenLogprobs.entropy is set when accumulate_gradients_ is asked for it.
LossFn = Callable[[TokenLogprobs, Any], tuple[Tensor, dict[str, Tensor]]]


def micro_batches_to_run(loss_tokens_per_mb: list[int], runtime: Runtime) -> int:
    """How many leading micro-batches a step runs: through the last one with a loss token on
    any rank, and at least one.

    Packing fills rows in order, so the all-padding rows a step's share leaves over sit at the
    end (the fixed layout's unused rows, the all-padding micro-batches that
    even out the ranks' shares). Their loss and gradients
    are exactly zero, so skipping them changes no result and saves their forward and backward.
    Under FSDP2 every rank must run the same number of forward/backward passes, hence the
    maximum over ranks.
    """
    count = max((i + 1 for i, n in enumerate(loss_tokens_per_mb) if n), default=1)
    return int(all_reduce_max([count], runtime)[0])


def packed_logits(model: nn.Module, rows: PackedRows) -> Tensor:
    """What the LM head returns over packed rows (the logits [B, T, V], unless fnt.model.lm_head has
    replaced it); documents are kept apart as the attention kernel needs (fnt.model.attention)."""
    return model(**packed_inputs(model, rows)).logits


def forward_loss_tokens(
    model: nn.Module, rows: PackedRows, tokens: LossTokens, chunk_tokens: int
) -> tuple[Tensor, TokenLogprobs]:
    """The model's forward over packed rows: the head's output and the loss tokens' logprobs.

    chunk_tokens > 0: the head computes the logprobs in chunks of that many loss tokens and its
    output is their [1 or 2, N] statistics (fnt.model.lm_head.chunked_head). 0: the head's output is
    the full logits [B, T, V], from which the loss tokens' logprobs are taken.
    """
    if chunk_tokens == 0:
        logits = packed_logits(model, rows)
        return logits, logprobs_from_logits(logits, tokens)
    with chunked_head(model, tokens, chunk_tokens):
        stats = packed_logits(model, rows)  # what the head returned: the statistics
    return stats, logprobs_of(stats, tokens)


@dataclass(frozen=True)
class StepCounts:
    """A step's batch counted over all micro-batches of all ranks."""

    loss_tokens: float
    samples: float
    tokens: float


def step_counts(
    batch: Any,
    runtime: Runtime,
    rows_of: Callable[[Any], PackedRows] = lambda mb: mb,
    extra: Sequence[float] = (),
) -> tuple[StepCounts, list[float]]:
    """The step's global loss tokens, samples and tokens (positions), and the global sums of this
    rank's `extra` values (e.g. a step function's own decision counts): one all-reduce."""
    local = [
        float(sum(row_layout(rows_of(mb)).num_loss_tokens for mb in batch.micro_batches)),
        float(batch.num_samples),
        float(sum(rows_of(mb).num_tokens for mb in batch.micro_batches)),
        *map(float, extra),
    ]
    loss_tokens, samples, tokens, *sums = all_reduce_sums(local, runtime)
    return StepCounts(loss_tokens, samples, tokens), sums


@dataclass(frozen=True)
class StepTotals:
    """Global sums over ranks and micro-batches of one step's forward/backward."""

    loss_sum: Tensor  # [] float32, the loss summed over the finite micro-batches
    nan_count: Tensor  # [] float32, micro-batches left out for a non-finite loss
    sums: dict[str, Tensor]  # the loss function's extra metric sums
    loss_tokens: float
    samples: float
    tokens: float
    # [L, E + 2] summed router statistics (fnt.model.moe), None if dense
    moe_stats: Optional[Tensor]
    # What the loss sum was divided by: None for the loss tokens, else (e.g.) the samples
    loss_denominator: Optional[float] = None

    def metrics(self) -> dict[str, Tensor]:
        """loss/mean, loss/nan_count and, for MoE models, the router statistics."""
        denominator = self.loss_tokens if self.loss_denominator is None else self.loss_denominator
        out = {
            "loss/mean": self.loss_sum / max(denominator, 1.0),
            "loss/nan_count": self.nan_count,
        }
        if self.moe_stats is not None:
            out.update(moe_metrics(self.moe_stats))
        return out


def accumulate_gradients_(
    model: nn.Module,
    batch: Any,
    runtime: Runtime,
    loss_fn: LossFn,
    rows_of: Callable[[Any], PackedRows] = lambda mb: mb,
    *,
    temperatures_of: Optional[Callable[[Any], Tensor]] = None,
    top_ps_of: Optional[Callable[[Any], Optional[Tensor]]] = None,
    entropy: bool = False,
    chunk_tokens: int = ModelConfig.loss_chunk_tokens,
    per_sample: bool = False,
    counts: Optional[StepCounts] = None,
) -> StepTotals:
    """Accumulate into `.grad` the gradient of (global loss sum / global loss-token count), or
    of (global loss sum / global sample count) when `per_sample` (a loss that sums per-sample
    means, such as RL's loss.aggregation = "sequence").

    `batch.micro_batches` are run one after another; `rows_of(mb)` gives a micro-batch's packed
    rows. `loss_fn` gets the loss tokens' logprobs at the temperatures `temperatures_of(mb)`
    ([B, T], token t's at t; None means 1), over the nuclei `top_ps_of(mb)` ([B, T], the top-p
    each token was sampled with; None means 1: the full vocabulary, fnt.model.lm_head), with
    their entropies when `entropy` is true, computed in chunks of `chunk_tokens` loss tokens (0:
    from the full logits; model.loss_chunk_tokens).
    Trailing micro-batches that have no loss token on any rank are not run (see
    `micro_batches_to_run`). A micro-batch whose loss is NaN/inf is left out of the loss and
    counted, decided on the device: it back-propagates zeros through the same graph (so every
    rank runs the same backward collectives under FSDP2); should non-finite values still reach
    the gradients (a forward that made NaN activations), the global grad norm is non-finite and
    `optimizer_update_` skips the update. Nothing is read back from the device: the counts come
    from the rows' host layouts (fnt.batch.row_layout). `counts` are the step's `step_counts`,
    when the step function has them already (else they are counted here).
    """
    device, distributed = runtime.device, runtime.distributed
    loss_tokens_per_mb = [row_layout(rows_of(mb)).num_loss_tokens for mb in batch.micro_batches]
    if counts is None:
        counts, _ = step_counts(batch, runtime, rows_of)
    loss_tokens, samples, tokens = counts.loss_tokens, counts.samples, counts.tokens
    # FSDP2 averages gradients over the data-parallel ranks; scaling by dp turns that average
    # back into the global sum before the division by the global count.
    denominator = samples if per_sample else loss_tokens
    scale = runtime.dims.dp / max(denominator, 1.0)

    top_k = moe_top_k(model)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    nan_count = torch.zeros((), dtype=torch.float32, device=device)
    sums: dict[str, Tensor] = {}
    moe_stats = None
    with casts_kept_for_the_step(runtime):
        for mb in batch.micro_batches[: micro_batches_to_run(loss_tokens_per_mb, runtime)]:
            mb = to_device(mb, device)
            rows = rows_of(mb)
            temperatures = None if temperatures_of is None else temperatures_of(mb)
            top_ps = None if top_ps_of is None else top_ps_of(mb)
            wanted = loss_tokens_of(rows, temperatures, entropy, top_ps)
            with record_router_logits(model) as router_logits:
                head_out, logprobs = forward_loss_tokens(model, rows, wanted, chunk_tokens)
            if top_k:
                stats = router_stats(router_logits, top_k)
                moe_stats = stats if moe_stats is None else moe_stats + stats
            mb_loss, mb_sums = loss_fn(logprobs, mb)
            # Decided on the device, never read back: a non-finite loss adds nothing, and the
            # gradient that reaches the head's output is exactly zero (the loss's own backward may
            # turn its zero gradient into NaN, zero times a NaN input), so every rank runs the same
            # backward and the parameters get zeros from this micro-batch.
            finite = torch.isfinite(mb_loss)
            zero = torch.zeros((), dtype=mb_loss.dtype, device=mb_loss.device)
            head_out.register_hook(lambda grad, finite=finite: torch.where(finite, grad, 0.0))
            (torch.where(finite, mb_loss, zero) * scale).backward()
            loss_sum += torch.where(finite, mb_loss.detach(), zero)
            nan_count += (~finite).float()
            for key, value in mb_sums.items():
                value = value.detach().float()
                sums[key] = sums.get(key, 0.0) + torch.where(finite, value, torch.zeros_like(value))
    keys = sorted(sums)
    reduced = all_reduce_sum(
        torch.stack(
            [loss_sum, nan_count, *(torch.as_tensor(sums[k], device=device) for k in keys)]
        ),
        distributed,
    )
    if moe_stats is not None:
        moe_stats = all_reduce_sum(moe_stats, distributed)
    return StepTotals(
        loss_sum=reduced[0],
        nan_count=reduced[1],
        sums=dict(zip(keys, reduced[2:])),
        loss_tokens=loss_tokens,
        samples=samples,
        tokens=tokens,
        moe_stats=moe_stats,
        loss_denominator=samples if per_sample else None,
    )


def casts_kept_for_the_step(runtime: Runtime) -> contextlib.AbstractContextManager:
    """Around a step's micro-batches when the model computes under autocast (one process,
    float32 masters): an autocast region that is off, inside which the model's own region
    nests, so autocast keeps its casts of the masters until the step ends (it clears them when
    its outermost region closes): each is cast once a step, not once a micro-batch and again in
    each recomputed loss chunk. The loss and the backward run outside autocast, as before."""
    if not runtime.offload.autocast:
        return contextlib.nullcontext()
    return torch.autocast(runtime.device.type, enabled=False)


@contextlib.contextmanager
def step_rng(state: TrainState) -> Iterator[None]:
    """Inside the block torch's RNG (the CPU's and the state's device's) is seeded by (seed, the
    step being made, rank), so the dropout masks of a step (model.lora.dropout) are a function
    of the state: a resumed run draws what an uninterrupted one drew. The caller's RNG state
    comes back on exit."""
    runtime = state.handles.runtime
    key = f"dropout/{state.config.seed}/{state.progress.step + 1}/{runtime.rank}"
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    device = runtime.device
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        yield


def grad_norm_(params: list[Tensor], max_norm: float) -> Tensor:
    """The global L2 norm of the gradients; clips them to max_norm when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # a DTensor under FSDP2: reduce the shards' norms
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def optimizer_update_(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, config, skip: bool = False
) -> dict[str, Tensor | float]:
    """Set the step's LR, measure/clip the grad norm, update, zero grads. Returns optim/* metrics.

    A non-finite gradient norm skips the update on every rank (the norm is global, so all ranks
    agree), so NaN never reaches the weights. `skip` (which every rank must pass alike, e.g. a
    decision all-reduced by the step function) skips it too, without measuring the norm: the
    step had nothing to learn from, and its grad norm is reported as NaN.
    """
    lr = lr_at(step, config.optim.lr, config.schedule, config.max_steps)
    set_lr_(optimizer, lr)
    if skip:
        optimizer.zero_grad(set_to_none=True)
        return {"optim/lr": lr, "optim/grad_norm": float("nan"), "optim/skipped": 1.0}
    params = [p for p in model.parameters() if p.requires_grad]
    norm = grad_norm_(params, config.optim.max_norm)
    found_inf = (~torch.isfinite(norm)).float()
    if skips_on_device(optimizer, norm):
        # The fused kernels read found_inf themselves and leave every tensor as it was when it
        # is 1 (GradScaler's protocol), so the decision is never read back to the host.
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bool(found_inf):  # the one read back of the update
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"optim/lr": lr, "optim/grad_norm": norm, "optim/skipped": found_inf}


def skips_on_device(optimizer: torch.optim.Optimizer, norm: Tensor) -> bool:
    """Whether the optimizer can skip a non-finite update on the device: torch's fused
    optimizers take GradScaler's found_inf, a plain tensor (not a DTensor, hence one process)."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    amp = getattr(optimizer, "_step_supports_amp_scaling", False)
    return fused and amp and type(norm) is Tensor


def complete_step_(
    state: TrainState,
    batch: Any,
    totals: StepTotals,
    loss_metrics: Optional[Mapping[str, Any]] = None,
    fwd_bwd_seconds: Optional[float | Elapsed] = None,
    skip_update: bool = False,
) -> tuple[TrainState, dict[str, Any]]:
    """The shared tail of every step: optimizer update, the step's metrics, the successor state.

    `loss_metrics` are the step function's own (e.g. loss/perplexity, entropy/all/mean); the
    batch's data-side metrics are appended so the row carries them too; `fwd_bwd_seconds`, when
    measured, becomes time/forward_backward. `skip_update` (the same on every rank) makes no
    update, as a non-finite gradient does (optimizer_update_); the step still counts, so its
    data is consumed and its row written.
    """
    handles = state.handles
    optim_metrics = optimizer_update_(
        handles.model, handles.optimizer, state.progress.step + 1, state.config, skip_update
    )
    timing = {} if fwd_bwd_seconds is None else {"time/forward_backward": fwd_bwd_seconds}
    metrics = merge_metrics(
        totals.metrics(), loss_metrics or {}, optim_metrics, timing, batch.metrics
    )
    progress = state.progress
    next_state = state.advance(
        total_tokens=progress.total_tokens + int(totals.tokens),
        total_samples=progress.total_samples + int(totals.samples),
        data=batch.data_after,
    )
    return next_state, metrics
