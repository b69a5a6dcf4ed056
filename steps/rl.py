"""The RL step function and its loss. Side effects: `rl_step` runs forward/backward (and the
reference model's forward), collectives and the optimizer update on the referents of
`state.handles` (it does not log, print, checkpoint or profile); every other function here is
pure, except `reference_logprobs`, which runs the reference model.

The per-token losses of every `loss.kind`, the reference KL term and the aggregation are defined
in steps/rl_losses.py. Per loss token t (loss_mask[t]; token x_t is predicted from the logits at
t-1), with tau_t the temperature token t was sampled at:

    logp_t   = log_softmax(logits[t-1] / tau_t)[x_t]                     (float32)
               (over the nucleus a token sampled with top-p < 1 came from: fnt/model/lm_head.py)
    loss     = sum of l_t over the loss tokens of every micro-batch on every rank / N
               ("token"), or the sum of each sample's mean l_t / S ("sequence")

N is the global number of loss tokens of the step (masked tokens included), S the global
number of samples. The LM head computes logp_t (and H_t below) in chunks of
`model.loss_chunk_tokens` loss tokens, without ever holding the full logits (fnt/model/lm_head.py).
The reference policy's logprobs (loss.ref_kl_tau > 0) are the batch's own (external rollouts
with ref_logprobs, loss.ref_source = "rollouts") or come from the frozen reference model in
`state.handles.ref_model`, at the same temperatures and in the same chunks, without gradient,
over the whole vocabulary (no nucleus: KL to the reference stays finite); with LoRA that model
is the policy itself, run with its adapters off (its base).

A step whose every loss token has advantage 0 (every group's rewards were equal, or skipped
for a bad reward) is skipped on every rank alike when the loss is then exactly 0 in gradient
(steps.rl_losses.zero_without_advantages: a built-in kind without the kl_tau penalty, or with
it on tokens without inference logprobs, and without the reference KL; never a custom loss):
the decision is all-reduced, no forward, backward or update runs, the step still counts (its
prompts are consumed, its row written with optim/skipped = 1 and skipped/zero_advantage = 1,
its loss and entropy NaN). Otherwise the penalties are a learning signal of their own and the
step trains.

Metrics of a step (sums come back over micro-batches and ranks; fnt.update):

    entropy/all/mean      sum of H_t / N, H_t the entropy of softmax(logits[t-1] / tau_t)
    mismatch_kl/all/mean  sum of (r_t - log r_t - 1) / N_q over the N_q loss tokens that have
                          inference logprobs: the k3 estimate of KL(sampler || trainer)
    kl_ent_ratio/mean     mismatch_kl/all/mean / entropy/all/mean: the sampler/trainer mismatch
                          relative to how spread out the policy is
    masked/high_fraction  tokens masked where the probability went up (A > 0 for the
                          sign-aware kinds), / N
    masked/low_fraction   tokens masked where it went down, / N
    ref_kl/mean           the k3 estimate of KL(policy || reference), mean over the loss tokens
                          (only with the reference KL on)
    loss/is_clipped_fraction  loss.is_correction = "tis": the units (loss tokens at
                          loss.is_level "token", samples at "sequence") whose weight was truncated,
                          / the units
    loss/is_masked_fraction   "mis": the units whose ratio left loss.is_bounds (weight 0), / the
                          units
    loss/is_weight_mean   with a correction: the mean weight w over the units
    skipped/zero_advantage  1 when the step was skipped for all-zero advantages, else 0

The two mismatch metrics appear only when N_q > 0; the loss/is_* ones whenever
loss.is_correction is not "none" (the config says so, known on the host), which needs the
sampler's logprobs: a step without them stops the run with a ConfigError. loss/mean,
loss/nan_count and optim/* come from fnt.update; the batch's own metrics (reward/mean, ...) are
appended there too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
from torch import Tensor, nn

from fnt.batch import RLBatch, RLMicroBatch, host_array, row_layout, to_device
from fnt.config import RLLossConfig
from fnt.config.losses import IS_CORRECTIONS
from fnt.distributed.runtime import Runtime
from fnt.errors import ConfigError
from fnt.model.lm_head import TokenLogprobs, loss_tokens_of
from fnt.model.lm_head import at_loss_tokens as values_at_loss_tokens
from fnt.model.lora import adapters_disabled
from fnt.obs.metrics import Elapsed
from fnt.state import TrainState
from fnt.update import (
    StepCounts,
    StepTotals,
    accumulate_gradients_,
    complete_step_,
    forward_loss_tokens,
    micro_batches_to_run,
    step_counts,
    step_rng,
)
from steps.rl_losses import (
    LossInputs,
    aggregate,
    aggregation_of,
    per_sample,
    ref_kl_k3,
    token_loss,
    zero_without_advantages,
)

# The metric sums every micro-batch's loss returns. All keys are always present: the sums are
# all-reduced as one stacked tensor, so every rank must send the same keys.
SUM_KEYS = (
    "entropy",
    "masked_high",
    "masked_low",
    "mismatch_kl",
    "mismatch_tokens",
    "ref_kl",
    "ref_kl_tokens",
    "is_weight",
    "is_clipped",
    "is_masked",
    "is_units",
)


def policy_loss(
    inputs: LossInputs, config: RLLossConfig, max_new_tokens: Optional[int] = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's aggregated loss (before the division by N or S) and the metric sums of
    SUM_KEYS but the entropy; `max_new_tokens` is the constant aggregation's L."""
    terms = token_loss(inputs, config)
    loss = aggregate(terms.loss, inputs, aggregation_of(config), max_new_tokens)
    zero = inputs.logp.new_zeros(())
    sums = {
        "masked_high": terms.masked_high.sum().float(),
        "masked_low": terms.masked_low.sum().float(),
        "mismatch_kl": zero,
        "mismatch_tokens": zero,
        "ref_kl": zero,
        "ref_kl_tokens": zero,
        "is_weight": zero,
        "is_clipped": zero,
        "is_masked": zero,
        "is_units": zero,
    }
    if terms.correction is not None:
        units = terms.correction.unit_weight
        sums["is_weight"] = units.sum().float()
        sums["is_clipped"] = terms.correction.clipped.sum().float()
        sums["is_masked"] = terms.correction.masked.sum().float()
        sums["is_units"] = inputs.logp.new_tensor(float(units.numel()))
    count = inputs.logp.new_tensor(float(inputs.logp.numel()))
    if inputs.inference_logprobs is not None:
        log_ratio = (inputs.logp - inputs.inference_logprobs).detach().double()
        sums["mismatch_kl"] = (log_ratio.exp() - log_ratio - 1).sum().float()
        sums["mismatch_tokens"] = count
    if config.ref_kl_tau and inputs.ref_logprobs is not None:
        sums["ref_kl"] = ref_kl_k3(inputs.logp, inputs.ref_logprobs).sum().float()
        sums["ref_kl_tokens"] = count
    return loss, sums


def loss_inputs(logprobs: TokenLogprobs, mb: RLMicroBatch) -> LossInputs:
    """The micro-batch's loss tokens as the loss kinds see them (steps/rl_losses.py)."""

    def at_loss_tokens(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else values_at_loss_tokens(mb.rows, t).float()

    layout = row_layout(mb.rows)
    sample_ids, num_samples = layout.loss_sample, layout.num_samples
    return LossInputs(
        logp=logprobs.logp,
        inference_logprobs=at_loss_tokens(mb.inference_logprobs),
        ref_logprobs=at_loss_tokens(mb.ref_logprobs),
        advantages=at_loss_tokens(mb.advantages),
        sample_ids=sample_ids,
        num_samples=num_samples,
    )


def rl_loss(
    logprobs: TokenLogprobs,
    mb: RLMicroBatch,
    config: RLLossConfig,
    max_new_tokens: Optional[int] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The LossFn of RL (with its config bound): the loss sum and the metric sums of SUM_KEYS.

    `logprobs` are at the sampling temperatures, with entropies (see `rl_gradients_`).
    """
    loss, sums = policy_loss(loss_inputs(logprobs, mb), config, max_new_tokens)
    return loss, {"entropy": logprobs.entropy.sum(), **sums}


@torch.no_grad()
def reference_logprobs(
    ref_model: nn.Module, batch: RLBatch, runtime: Runtime, chunk_tokens: int
) -> RLBatch:
    """The batch with `ref_logprobs` [B, T] set on every micro-batch: the reference model's
    logprob of each loss token at its sampling temperature (0 elsewhere), on the device.

    Runs the micro-batches `accumulate_gradients_` will run (the same count on every rank, as
    FSDP2 needs); the trailing ones without a loss token on any rank get zeros.
    """
    counts = [row_layout(mb.rows).num_loss_tokens for mb in batch.micro_batches]
    to_run = micro_batches_to_run(counts, runtime)
    out = []
    for i, mb in enumerate(batch.micro_batches):
        mb = to_device(mb, runtime.device)
        ref = torch.zeros(mb.rows.input_ids.shape, dtype=torch.float32, device=runtime.device)
        if i < to_run:
            tokens = loss_tokens_of(mb.rows, mb.temperatures)
            with adapters_disabled(ref_model):  # a LoRA policy's base is its reference
                _, logprobs = forward_loss_tokens(ref_model, mb.rows, tokens, chunk_tokens)
            ref.view(-1).index_copy_(0, tokens.index + 1, logprobs.logp.float())
            if hasattr(ref_model, "reshard"):  # FSDP2 keeps the root unsharded after a forward
                ref_model.reshard()
        out.append(dataclasses.replace(mb, ref_logprobs=ref))
    return dataclasses.replace(batch, micro_batches=tuple(out))


def rl_gradients_(
    model: nn.Module,
    batch: RLBatch,
    runtime: Runtime,
    config: RLLossConfig,
    chunk_tokens: int,
    ref_model: Optional[nn.Module] = None,
    counts: Optional[StepCounts] = None,
    max_new_tokens: Optional[int] = None,
) -> StepTotals:
    """accumulate_gradients_ with the RL loss: logprobs and entropies at each token's sampling
    temperature, in chunks of `chunk_tokens` loss tokens (0: from the full logits). With
    loss.ref_kl_tau > 0 and `ref_model`, the reference logprobs come from it first. `counts`:
    the step's global counts, when the caller has them (fnt.update.step_counts);
    `max_new_tokens`: the constant aggregation's L (rollout.max_new_tokens)."""
    if config.ref_kl_tau and ref_model is not None:
        batch = reference_logprobs(ref_model, batch, runtime, chunk_tokens)
    return accumulate_gradients_(
        model,
        batch,
        runtime,
        lambda logprobs, mb: rl_loss(logprobs, mb, config, max_new_tokens),
        rows_of=lambda mb: mb.rows,
        temperatures_of=lambda mb: mb.temperatures,
        top_ps_of=lambda mb: mb.top_ps,
        entropy=True,
        chunk_tokens=chunk_tokens,
        per_sample=per_sample(aggregation_of(config)),
        counts=counts,
    )


def rl_metrics(
    totals: StepTotals,
    with_inference: Optional[bool] = None,
    with_reference: Optional[bool] = None,
    is_correction: str = "none",
) -> dict[str, Tensor]:
    """The step's RL metrics from the global sums (see the module docstring). The mismatch
    metrics are there when `with_inference` (the loss tokens have the sampler's logprobs) and
    ref_kl/mean when `with_reference`; a flag not given is read from the sums' token counts,
    which costs a read back from the device. loss/is_* are there for an `is_correction`
    (loss.is_correction) other than "none"."""
    nan = torch.tensor(float("nan"))
    # A step whose every micro-batch was non-finite has no sums; its row says NaN, not 0.
    sums = {key: totals.sums.get(key, nan) for key in SUM_KEYS}
    n = max(totals.loss_tokens, 1.0)
    entropy = sums["entropy"] / n
    metrics = {
        "entropy/all/mean": entropy,
        "masked/high_fraction": sums["masked_high"] / n,
        "masked/low_fraction": sums["masked_low"] / n,
    }
    if with_inference is None or with_reference is None:
        mismatch_tokens, ref_tokens = torch.stack(
            [sums["mismatch_tokens"].float().cpu(), sums["ref_kl_tokens"].float().cpu()]
        ).tolist()
        with_inference, with_reference = mismatch_tokens > 0, ref_tokens > 0
    if with_inference:
        mismatch_kl = sums["mismatch_kl"] / sums["mismatch_tokens"]
        metrics["mismatch_kl/all/mean"] = mismatch_kl
        metrics["kl_ent_ratio/mean"] = mismatch_kl / entropy
    if with_reference:
        metrics["ref_kl/mean"] = sums["ref_kl"] / sums["ref_kl_tokens"]
    counts = IS_CORRECTIONS[is_correction].counts
    if counts:
        metrics[f"loss/is_{counts}_fraction"] = sums[f"is_{counts}"] / sums["is_units"]
        metrics["loss/is_weight_mean"] = sums["is_weight"] / sums["is_units"]
    return metrics


def counts_and_zero_advantage(batch: RLBatch, runtime: Runtime) -> tuple[StepCounts, bool]:
    """The step's global counts and whether every loss token of the step, on every rank, has
    advantage 0: one all-reduce for both, so every rank decides alike."""
    nonzero = sum(
        int(np.count_nonzero(host_array(mb.advantages)[host_array(mb.rows.loss_mask)]))
        for mb in batch.micro_batches
    )
    counts, (total_nonzero,) = step_counts(batch, runtime, lambda mb: mb.rows, extra=[nonzero])
    return counts, total_nonzero == 0


def skipped_totals(counts: StepCounts, per_sample: bool) -> StepTotals:
    """The totals of a step that ran no forward/backward: NaN loss, no metric sums."""
    return StepTotals(
        loss_sum=torch.tensor(float("nan")),
        nan_count=torch.zeros(()),
        sums={},
        loss_tokens=counts.loss_tokens,
        samples=counts.samples,
        tokens=counts.tokens,
        moe_stats=None,
        loss_denominator=counts.samples if per_sample else None,
    )


def rl_step(state: TrainState, batch: RLBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches with the loss of `state.config.loss`;
    no update, on every rank, when every advantage of the step is 0 (module docstring)."""
    batch.check()
    state.check_current()
    timer = Elapsed(state.handles.runtime.device)
    config, runtime = state.config.loss, state.handles.runtime
    counts, zero_advantages = counts_and_zero_advantage(batch, runtime)
    with_inference = any(mb.inference_logprobs is not None for mb in batch.micro_batches)
    if config.is_correction != "none" and not with_inference:
        raise ConfigError(
            f"'loss.is_correction' = {config.is_correction!r}: weighs each token by the "
            f"sampler's probability, but step {state.progress.step + 1}'s samples have no "
            "inference logprobs (external rollouts: give every sample 'inference_logprobs')"
        )
    skip = zero_advantages and zero_without_advantages(config, with_inference)
    if skip:
        totals = skipped_totals(counts, per_sample(aggregation_of(config)))
    else:
        with step_rng(state):
            totals = rl_gradients_(
                state.handles.model,
                batch,
                runtime,
                config,
                state.config.model.loss_chunk_tokens,
                ref_model=state.handles.ref_model,
                counts=counts,
                max_new_tokens=state.config.rollout.max_new_tokens,
            )
    # Which metrics the step has follows from the batch and the config, known on the host.
    trained = not skip and counts.loss_tokens > 0
    with_reference = bool(config.ref_kl_tau) and (
        state.handles.ref_model is not None
        or any(mb.ref_logprobs is not None for mb in batch.micro_batches)
    )
    metrics = {
        **rl_metrics(
            totals, trained and with_inference, trained and with_reference, config.is_correction
        ),
        "skipped/zero_advantage": 1.0 if skip else 0.0,
    }
    return complete_step_(state, batch, totals, metrics, timer.stop_(), skip_update=skip)
