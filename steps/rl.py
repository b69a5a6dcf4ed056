"""The RL step function and its loss. Side effects: `rl_step` runs forward/backward, collectives
and the optimizer update on the referents of `state.handles` (it does not log, print, checkpoint
or profile); every other function here is pure.

The loss, per loss token t (loss_mask[t]; token x_t is predicted from the logits at t-1), with
tau_t the temperature token t was sampled at, A_t its advantage and q_t its inference logprob:

    logp_t   = log_softmax(logits[t-1] / tau_t)[x_t]                     (float32)
    log r_t  = logp_t - q_t                with inference logprobs
             = logp_t - stopgrad(logp_t)   without: r_t = 1 in value, d r_t = d logp_t
    r_t      = exp(log r_t)
    masked_t = (A_t > 0 and r_t > 1 + eps_high) or (A_t < 0 and r_t < 1 - eps_low)
    l_t      = -(1 - masked_t) * A_t * r_t  +  kl_tau * (log r_t)^2

    loss     = sum of l_t over the loss tokens of every micro-batch on every rank / N
    N        = the global number of loss tokens of the step, masked tokens included

The LM head computes logp_t (and H_t below) in chunks of `model.loss_chunk_tokens` loss tokens,
without ever holding the full logits (fnt/lm_head.py).

`masked_t` is decided on values, without gradient: a token whose ratio has already moved past
the bound in the direction its advantage pushes gets no policy-gradient term (PPO clipping
without the min). Masked tokens stay in N, so one denominator serves every term and masking a
token never enlarges the others' weight. The mask applies to the policy-gradient term only; the
penalty acts on every loss token, since it is what pulls a runaway ratio back toward 1. Without
inference logprobs the gradient is REINFORCE's, -A_t * d logp_t / N, and the penalty is 0.

Metrics of a step (sums come back over micro-batches and ranks; fnt.update):

    entropy/all/mean      sum of H_t / N, H_t the entropy of softmax(logits[t-1] / tau_t)
    mismatch_kl/all/mean  sum of (r_t - log r_t - 1) / N_q over the N_q loss tokens that have
                          inference logprobs: the k3 estimate of KL(sampler || trainer)
    kl_ent_ratio/mean     mismatch_kl/all/mean / entropy/all/mean: the sampler/trainer mismatch
                          relative to how spread out the policy is
    masked/high_fraction  tokens masked for A > 0 and r > 1 + eps_high, / N
    masked/low_fraction   tokens masked for A < 0 and r < 1 - eps_low, / N

The two mismatch metrics appear only when N_q > 0. loss/mean, loss/nan_count and optim/* come
from fnt.update; the batch's own metrics (reward/mean, ...) are appended there too.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from fnt.batch import RLBatch, RLMicroBatch
from fnt.config import RLLossConfig
from fnt.lm_head import TokenLogprobs
from fnt.setup import Runtime
from fnt.state import TrainState
from fnt.update import StepTotals, accumulate_gradients_, complete_step_

# The metric sums every micro-batch's loss returns. All keys are always present: the sums are
# all-reduced as one stacked tensor, so every rank must send the same keys.
SUM_KEYS = ("entropy", "masked_high", "masked_low", "mismatch_kl", "mismatch_tokens")


def policy_loss(
    logp: Tensor, inference_logprobs: Tensor | None, advantages: Tensor, config: RLLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss sum over N loss tokens and the metric sums (no entropy), all inputs [N] float32."""
    if inference_logprobs is None:
        log_ratio = logp - logp.detach()
    else:
        log_ratio = logp - inference_logprobs
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    masked_high = (advantages > 0) & (r > 1 + config.eps_high)
    masked_low = (advantages < 0) & (r < 1 - config.eps_low)
    keep = ~(masked_high | masked_low)
    loss = -(advantages * ratio)[keep].sum()
    if config.kl_tau:
        loss = loss + config.kl_tau * log_ratio.square().sum()
    zero = logp.new_zeros(())
    sums = {
        "masked_high": masked_high.sum().float(),
        "masked_low": masked_low.sum().float(),
        "mismatch_kl": zero,
        "mismatch_tokens": zero,
    }
    if inference_logprobs is not None:
        sums["mismatch_kl"] = (r - log_ratio.detach() - 1).sum()
        sums["mismatch_tokens"] = logp.new_tensor(float(logp.numel()))
    return loss, sums


def rl_loss(
    logprobs: TokenLogprobs, mb: RLMicroBatch, config: RLLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The LossFn of RL (with its config bound): the loss sum and the metric sums of SUM_KEYS.

    `logprobs` are at the sampling temperatures, with entropies (see `rl_gradients_`).
    """
    mask = mb.rows.loss_mask[:, 1:]
    inference = mb.inference_logprobs
    if inference is not None:
        inference = inference[:, 1:][mask].float()
    loss, sums = policy_loss(logprobs.logp, inference, mb.advantages[:, 1:][mask].float(), config)
    return loss, {"entropy": logprobs.entropy.sum(), **sums}


def rl_gradients_(
    model: nn.Module, batch: RLBatch, runtime: Runtime, config: RLLossConfig, chunk_tokens: int
) -> StepTotals:
    """accumulate_gradients_ with the RL loss: logprobs and entropies at each token's sampling
    temperature, in chunks of `chunk_tokens` loss tokens (0: from the full logits)."""
    return accumulate_gradients_(
        model,
        batch,
        runtime,
        lambda logprobs, mb: rl_loss(logprobs, mb, config),
        rows_of=lambda mb: mb.rows,
        temperatures_of=lambda mb: mb.temperatures,
        entropy=True,
        chunk_tokens=chunk_tokens,
    )


def rl_metrics(totals: StepTotals) -> dict[str, Tensor]:
    """The step's RL metrics from the global sums (see the module docstring)."""
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
    # The key set depends on the data, so this costs one host sync per step.
    if float(sums["mismatch_tokens"]) > 0:
        mismatch_kl = sums["mismatch_kl"] / sums["mismatch_tokens"]
        metrics["mismatch_kl/all/mean"] = mismatch_kl
        metrics["kl_ent_ratio/mean"] = mismatch_kl / entropy
    return metrics


def rl_step(state: TrainState, batch: RLBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches with the loss of `state.config.loss`."""
    batch.check()
    state.check_current()
    started = time.perf_counter()
    totals = rl_gradients_(
        state.handles.model,
        batch,
        state.handles.runtime,
        state.config.loss,
        state.config.model.loss_chunk_tokens,
    )
    return complete_step_(state, batch, totals, rl_metrics(totals), time.perf_counter() - started)
