"""The RL loss family: the per-token loss of each `loss.kind`, the reference-model KL term and
the aggregation over samples. Pure, except that resolving `loss.custom` imports its module.

Every kind maps the N loss tokens of one micro-batch (LossInputs) to a per-token loss l_t and
the tokens it masked (TokenLoss). Notation, per loss token t of sample i:

    logp_t   the trainer's log-probability of the token at its sampling temperature (gradient)
    q_t      the sampler's (inference) log-probability; without one, q_t = stopgrad(logp_t)
    log r_t  = logp_t - q_t,   r_t = exp(log r_t)             (r = 1 in value without q)
    dp_t     = exp(logp_t) - exp(q_t), on values: how far the token's probability moved
    A_t      the sample's advantage, on each of its tokens
    sg(.)    stop-gradient; every mask is decided on values and carries no gradient

    kind       masked_t (no policy-gradient term)                       l_t
    dppo_tv    A_t > 0 and dp_t > dppo_mask_high,                      -(1 - masked_t) A_t r_t
               or A_t < 0 and dp_t < -dppo_mask_low                       + kl_tau (log r_t)^2
    ipo        |dp_t| > ipo_threshold                                  as dppo_tv
    ratio      A_t > 0 and r_t > 1 + eps_high,                         as dppo_tv
               or A_t < 0 and r_t < 1 - eps_low
    gspo       as ratio, on the sample's ratio s_i instead of r_t      -(1 - masked_t) A_t s_i
               s_i = exp(mean over the sample's tokens u of log r_u)      + kl_tau (log r_t)^2

`dppo_tv` is prime-rl's default loss (DPPO with the binary total-variation trust region: the
mask looks at the change of the token's probability, not at the ratio, so a rare token may move
by a large ratio while a likely one may not move by much), with its default thresholds 0.2 / 0.2
and kl_tau 1e-3; `ipo` is its symmetric variant (threshold 0.1). `ratio` is PPO's clipping
without the min: the token whose ratio has already moved past the bound in the direction its
advantage pushes gets no policy-gradient term. `gspo` (GSPO, Zheng et al. 2025) does the same
with one ratio per sample, the geometric mean of its token ratios, so the gradient of sample i
is -A_i s_i * mean_t d logp_t; its bounds are the paper's 3e-4 / 4e-4. The penalty
kl_tau (log r_t)^2 acts on every loss token, masked or not: it is what pulls a runaway ratio
back toward 1. Masked tokens contribute no policy-gradient term in value or gradient.

Numerical safety: r_t (and s_i) is exp of log r where the token is kept and exp(0) where it is
masked, so a masked token whose log ratio overflows float32 (log r > 88.7) gives neither inf nor
a NaN gradient. A kept token whose ratio overflows makes its micro-batch's loss inf, which
fnt.update leaves out and counts in loss/nan_count.

The reference-model KL (`loss.ref_kl_tau` > 0), with ref_t the reference policy's logprob at
the same temperature, adds to every kind

    ref_kl_tau * sg(w_t) * k2_t,   k2_t = (logp_t - ref_t)^2 / 2,
    d k2_t = (logp_t - ref_t) d logp_t

with w_t = r_t on the tokens the kind keeps (1 where it masked them, and 1 without inference
logprobs). For a token drawn from the policy at prefix s_t, (logp_t - ref_t) d logp_t is an
unbiased estimate of the gradient of the token-level KL(pi(. | s_t) || pi_ref(. | s_t)), the
prefix held fixed; drawn from an older sampler q (async or stale external rollouts), the
importance weight r_t = pi / q makes it unbiased again, as prime-rl weights it. (The popular
k3 = e^(ref - logp) - (ref - logp) - 1 as a loss has the gradient (1 - e^(ref - logp)) d logp,
which is not unbiased, and it overflows for a token the policy has made very unlikely.) The
metric ref_kl/mean is the mean of k3 over the loss tokens, an unbiased, non-negative estimate
of that KL itself, in float64 and without gradient.

Importance-sampling correction (`loss.is_correction`, at `loss.is_level`). In the kinds above
the ratio r_t = pi / q weighs the policy-gradient term against the sampler q directly: fnt makes
one update per batch, so the trainer's "old" policy pi_old of a PPO-style trainer (the policy
before this update) is the current one in value, sg(pi), and r_t factors into a part that
carries the gradient, pi / sg(pi) (1 in value), and the importance weight
rho_t = sg(pi) / q = pi_old / q that corrects for the sampler (an engine's numerics, an async or
stale policy). A correction replaces that weight by w, a constant of the gradient:

    l_t = -(1 - masked_t) A_t w_t exp(log r_t - sg(log r_t))  + kl_tau (log r_t)^2
        (gspo: exp(log s_i - sg(log s_i)) in place of the token's factor)

so the policy-gradient term of a kept token is -A_t w_t d logp_t instead of -A_t r_t d logp_t
(gspo: -A_i w_t d mean logp, w in place of the value of s_i, which is how TRL composes its
sequence-level ratio with its vLLM correction); the kind's masks (decided on r_t or s_i against
the sampler, as without a correction), the kl_tau penalty and the reference KL term with its
weight r_t are unchanged. This is verl's "bypass" mode with its policy-gradient loss and
rollout correction (the sampler as the proximal policy), with fnt's masks as the trust region.
With log rho_t = sg(logp_t) - q_t:

    is_level   the ratio rho it weighs with
    token      rho_t = exp(log rho_t), each token its own
    sequence   rho_i = exp(sum over the sample's loss tokens of log rho_t), the product of
               its token ratios (the likelihood ratio of the whole sample, as verl and TRL
               define their sequence modes; not GSPO's geometric mean), on each of its tokens

    is_correction  w                                      counted in
    none           the kind's r_t or s_i: today's loss     -
    tis            min(rho, is_cap)                         loss/is_clipped_fraction: rho > is_cap
    mis            rho if low <= rho <= high, else 0        loss/is_masked_fraction: outside
                   ([low, high] = is_bounds)

`tis` is truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl, C = 2; verl's rollout_is
"token" / "sequence" with rollout_is_threshold; TRL's vllm_importance_sampling_mode
token_truncate / sequence_truncate with vllm_importance_sampling_clip_max). `mis` is masked
importance sampling: a token (or a whole sample) whose ratio leaves the bounds gets no
policy-gradient term, the others keep their full ratio (TRL's token_mask / sequence_mask;
verl's sequence IS with sequence rejection, Liu, Li et al. 2025, "When Speed Kills
Stability"); at the token level it is IcePop (Ring-1T, "Every Step Evolves", 2025: M(k) = k for
k in [alpha, beta], else 0, with alpha = 0.5 and beta = 5). Both keep the estimator's direction
and bound its variance: tis by biasing the rare large weights down, mis by dropping them. A
sample is a trained sequence as packed (an episode split into branches is one per branch), so
its tokens are in one micro-batch. Counts are of tokens at the token level and of samples at
the sequence level; loss/is_weight_mean is the mean w over the same units.

Aggregation (`loss.aggregation`), with N the step's global number of loss tokens, S its global
number of samples (all micro-batches, all ranks; fnt.update divides) and L =
rollout.max_new_tokens:

    token     loss = sum over every loss token of l_t / N                        (DAPO)
    sequence  loss = sum over samples i of (sum over i's tokens of l_t / |y_i|) / S   (GRPO)
    constant  loss = sum over every loss token of l_t / (S L)                    (Dr. GRPO)

Token-mean weighs every token alike, so long samples carry more weight; sequence-mean weighs
every sample alike, so a token of a short sample counts more; constant divides by the same
number whatever the lengths, so neither the batch's length mix nor a sample's own length scales
its tokens (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"). Masked tokens
stay in N and |y_i|. `gspo` always uses the sequence form, whatever loss.aggregation says: its
objective is the mean over samples of -A_i s_i (Zheng et al. 2025), each sample weighted alike.

A custom loss (`loss.kind = "custom"`, `loss.custom = "module:function"`) is a function

    fn(inputs: LossInputs, config: RLLossConfig) -> Tensor | TokenLoss

returning l_t [N] float32 (differentiable through inputs.logp only), or a TokenLoss with its
masks for the masked/* metrics (a bare Tensor reports none masked). The aggregation and the
reference KL term apply to it as to the built-in kinds; loss.is_correction does not (the
config refuses the pair): a custom loss that wants the weights calls `is_weights` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from fnt.config import RLLossConfig
from fnt.config.losses import AGGREGATIONS, rl_loss
from fnt.config.references import import_function


@dataclass(frozen=True)
class LossInputs:
    """The N loss tokens of one micro-batch, row-major (the order of `t[:, 1:][loss_mask]`)."""

    logp: Tensor  # [N] float32, differentiable: the trainer's logprob at the sampling temperature
    inference_logprobs: Optional[Tensor]  # [N] float32, the sampler's logprob, or None
    ref_logprobs: Optional[Tensor]  # [N] float32, the reference policy's logprob, or None
    advantages: Tensor  # [N] float32, the token's sample's advantage (or its turn's)
    sample_ids: Tensor  # [N] int64 in [0, num_samples): the token's sample in this micro-batch
    num_samples: int  # samples (documents) of this micro-batch that have loss tokens
    # [N] float32 without gradient: loss.is_correction's weight w_t, which replaces the value
    # of the importance ratio in the policy-gradient term; None without a correction
    is_weight: Optional[Tensor] = None

    def log_ratio(self) -> Tensor:
        """log r_t [N]: logp - q, or logp - sg(logp) (0 in value) without inference logprobs."""
        if self.inference_logprobs is None:
            return self.logp - self.logp.detach()
        return self.logp - self.inference_logprobs

    def probability_change(self) -> Tensor:
        """dp_t [N] = exp(logp) - exp(q), without gradient (0 without inference logprobs)."""
        logp = self.logp.detach()
        if self.inference_logprobs is None:
            return torch.zeros_like(logp)
        return logp.exp() - self.inference_logprobs.exp()

    def sample_token_counts(self) -> Tensor:
        """|y_i| [num_samples] float32: the loss tokens of each sample."""
        counts = torch.zeros(self.num_samples, dtype=torch.float32, device=self.logp.device)
        return counts.index_add_(0, self.sample_ids, torch.ones_like(self.logp.detach()))


@dataclass(frozen=True)
class ISWeights:
    """loss.is_correction's weights for one micro-batch (module docstring), without gradient.
    A unit is a loss token at is_level "token", a sample at "sequence"."""

    token_weight: Tensor  # [N] float32, w_t: the weight of the token, or of its sample
    unit_weight: Tensor  # [U] float32, w of each unit
    clipped: Tensor  # [U] bool, units whose ratio tis truncated (rho > is_cap)
    masked: Tensor  # [U] bool, units whose ratio mis found outside is_bounds (w = 0)


@dataclass(frozen=True)
class TokenLoss:
    """What a loss kind returns: the per-token loss and the tokens it masked."""

    loss: Tensor  # [N] float32, l_t
    masked_high: Tensor  # [N] bool, masked where the probability went up (r > 1, dp > 0)
    masked_low: Tensor  # [N] bool, masked where it went down (r < 1, dp < 0)
    correction: Optional[ISWeights] = None  # token_loss sets it with loss.is_correction on


def kept_ratio(log_ratio: Tensor, keep: Tensor) -> Tensor:
    """exp(log r) where `keep`, exp(0) = 1 elsewhere: a masked entry never overflows, and its
    gradient is exactly 0 (through torch.where), not 0 * inf = NaN."""
    return torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))


def masked_policy_loss(
    inputs: LossInputs, log_ratio: Tensor, masked_high: Tensor, masked_low: Tensor, kl_tau: float
) -> TokenLoss:
    """-(1 - masked) A r + kl_tau (log r_t)^2 per token, with r = exp(log_ratio) (token-level, or
    a sample's ratio spread over its tokens), computed only where kept. With inputs.is_weight,
    r is w exp(log_ratio - sg(log_ratio)): w in value, the ratio's gradient (module
    docstring)."""
    keep = ~(masked_high | masked_low)
    if inputs.is_weight is None:
        ratio = kept_ratio(log_ratio, keep)
    else:
        ratio = kept_ratio(log_ratio - log_ratio.detach(), keep) * inputs.is_weight
    policy = torch.where(keep, -inputs.advantages * ratio, torch.zeros_like(ratio))
    loss = policy + kl_tau * inputs.log_ratio().square() if kl_tau else policy
    return TokenLoss(loss, masked_high, masked_low)


def dppo_tv_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """prime-rl's default (DPPO-binary TV): mask on dp = exp(logp) - exp(q) by the advantage's
    sign, A > 0 and dp > dppo_mask_high or A < 0 and dp < -dppo_mask_low; l_t = -(1 - masked)
    A r + kl_tau (log r)^2 (module docstring)."""
    dp = inputs.probability_change()
    high = (inputs.advantages > 0) & (dp > config.dppo_mask_high)
    low = (inputs.advantages < 0) & (dp < -config.dppo_mask_low)
    return masked_policy_loss(inputs, inputs.log_ratio(), high, low, config.kl_tau)


def ipo_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """IPO: mask where |dp| > ipo_threshold whatever the advantage's sign; l_t = -(1 - masked)
    A r + kl_tau (log r)^2. The masked/* metrics split the masked tokens by the sign of dp."""
    dp = inputs.probability_change()
    masked = dp.abs() > config.ipo_threshold
    return masked_policy_loss(
        inputs, inputs.log_ratio(), masked & (dp > 0), masked & (dp < 0), config.kl_tau
    )


def ratio_bounds_masks(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """(A > 0 and r > 1 + eps_high, A < 0 and r < 1 - eps_low), on values."""
    ratio = ratio.detach()
    return (advantages > 0) & (ratio > 1 + eps_high), (advantages < 0) & (ratio < 1 - eps_low)


def ratio_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """Ratio masking (PPO clipping without the min): mask A > 0 and r > 1 + eps_high or A < 0 and
    r < 1 - eps_low; l_t = -(1 - masked) A r + kl_tau (log r)^2."""
    log_ratio = inputs.log_ratio()
    # exp on values only: the mask needs no gradient, and an overflow to inf still compares.
    high, low = ratio_bounds_masks(
        log_ratio.detach().exp(), inputs.advantages, config.eps_low, config.eps_high
    )
    return masked_policy_loss(inputs, log_ratio, high, low, config.kl_tau)


def gspo_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """GSPO: the sample's ratio s_i = exp(mean of its tokens' log r), masked by the ratio rule
    with gspo_eps_low / gspo_eps_high; l_t = -(1 - masked) A_t s_i + kl_tau (log r_t)^2."""
    log_ratio = inputs.log_ratio()
    per_sample = torch.zeros(inputs.num_samples, dtype=log_ratio.dtype, device=log_ratio.device)
    per_sample = per_sample.index_add(0, inputs.sample_ids, log_ratio)
    mean_log_ratio = (per_sample / inputs.sample_token_counts().clamp_min(1.0))[inputs.sample_ids]
    high, low = ratio_bounds_masks(
        mean_log_ratio.detach().exp(),
        inputs.advantages,
        config.gspo_eps_low,
        config.gspo_eps_high,
    )
    return masked_policy_loss(inputs, mean_log_ratio, high, low, config.kl_tau)


LossKindFn = Callable[[LossInputs, RLLossConfig], Union[Tensor, TokenLoss]]

LOSS_KINDS: dict[str, LossKindFn] = {
    "dppo_tv": dppo_tv_loss,
    "ipo": ipo_loss,
    "ratio": ratio_loss,
    "gspo": gspo_loss,
}
"""The functions of the built-in kinds by their `loss.kind` name: every entry of
fnt.config.losses.RL_LOSSES but the custom one, whose function `loss.custom` names."""


@functools.cache  # resolved once per run, not once per micro-batch
def custom_loss_function(name: str) -> LossKindFn:
    """The function a `loss.custom` value "module:function" names
    (fnt.config.references.import_function: ValueError when it cannot be imported, is not
    callable or cannot take (inputs, config))."""
    return import_function(name, 2)


def loss_kind_function(config: RLLossConfig) -> LossKindFn:
    """The per-token loss function `config.kind` selects."""
    if rl_loss(config.kind).custom:
        return custom_loss_function(config.custom)
    return LOSS_KINDS[config.kind]


def is_weights(inputs: LossInputs, config: RLLossConfig) -> ISWeights:
    """loss.is_correction's weights at loss.is_level (module docstring), from the sampler's
    logprobs; the log ratios are summed and compared in float64 and in log space, so a long
    sample's product neither loses precision nor overflows. ValueError without the sampler's
    logprobs or for the correction "none", which has no weights."""
    if config.is_correction == "none":
        raise ValueError('loss.is_correction = "none" has no weights')
    if inputs.inference_logprobs is None:
        raise ValueError(
            f"loss.is_correction = {config.is_correction!r} needs the sampler's logprobs, but "
            "the micro-batch has no inference logprobs"
        )
    log_rho = inputs.logp.detach().double() - inputs.inference_logprobs.double()
    if config.is_level == "sequence":
        zeros = log_rho.new_zeros(inputs.num_samples)
        log_rho = zeros.index_add(0, inputs.sample_ids, log_rho)
    never = torch.zeros_like(log_rho, dtype=torch.bool)
    if config.is_correction == "tis":
        log_cap = math.log(config.is_cap)
        clipped, masked = log_rho > log_cap, never
        weight = log_rho.clamp_max(log_cap).exp()
    elif config.is_correction == "mis":
        low, high = config.is_bounds
        log_low = math.log(low) if low > 0 else -math.inf
        inside = (log_rho >= log_low) & (log_rho <= math.log(high))
        clipped, masked = never, ~inside
        # exp only of the kept log ratios: an outside one may overflow, and needs no value.
        kept = torch.where(inside, log_rho, torch.zeros_like(log_rho)).exp()
        weight = torch.where(inside, kept, torch.zeros_like(kept))
    else:
        raise ValueError(f"unknown loss.is_correction {config.is_correction!r}")
    weight = weight.to(inputs.logp.dtype)
    token_weight = weight[inputs.sample_ids] if config.is_level == "sequence" else weight
    return ISWeights(token_weight, weight, clipped, masked)


def token_loss(inputs: LossInputs, config: RLLossConfig) -> TokenLoss:
    """The selected kind's TokenLoss, plus ref_kl_tau * k2_t when the reference KL is on; with
    loss.is_correction, the kind weighs its policy-gradient term by `is_weights` (module
    docstring) and the TokenLoss carries them."""
    correction = None
    if config.is_correction != "none":
        correction = is_weights(inputs, config)
        inputs = dataclasses.replace(inputs, is_weight=correction.token_weight)
    out = loss_kind_function(config)(inputs, config)
    if isinstance(out, Tensor):
        none = torch.zeros_like(inputs.logp, dtype=torch.bool)
        out = TokenLoss(out, none, none)
    if out.loss.shape != inputs.logp.shape:
        raise ValueError(
            f"loss.kind = {config.kind!r} returned a per-token loss of shape "
            f"{tuple(out.loss.shape)}, expected {tuple(inputs.logp.shape)}"
        )
    if config.ref_kl_tau:
        if inputs.ref_logprobs is None:
            raise ValueError("loss.ref_kl_tau > 0 but the micro-batch has no reference logprobs")
        # The importance weight makes the term unbiased for tokens an older policy sampled.
        keep = ~(out.masked_high | out.masked_low)
        weight = kept_ratio(inputs.log_ratio().detach(), keep)
        kl = weight * ref_kl_k2(inputs.logp, inputs.ref_logprobs)
        out = TokenLoss(out.loss + config.ref_kl_tau * kl, out.masked_high, out.masked_low)
    if correction is not None:
        out = dataclasses.replace(out, correction=correction)
    return out


def zero_without_advantages(config: RLLossConfig, has_inference_logprobs: bool) -> bool:
    """Whether the loss's gradient is exactly 0 when every advantage is 0, so that such a step
    can be skipped: a kind whose entry says so (fnt.config.losses: the built-in kinds), as long
    as no other term acts, i.e. without the kl_tau penalty (or with it and no inference
    logprobs: log r is then 0 in value and gradient) and without the reference KL. Never a
    custom loss, which may have a signal of its own."""
    if not rl_loss(config.kind).zero_without_advantages or config.ref_kl_tau:
        return False
    return not config.kl_tau or not has_inference_logprobs


def ref_kl_k2(logp: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2_t = (logp - ref)^2 / 2 [N], differentiable in logp (module docstring)."""
    return 0.5 * (logp - ref_logprobs).square()


def ref_kl_k3(logp: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3_t = e^(ref - logp) - (ref - logp) - 1 [N] float64, without gradient: the estimate of
    KL(pi || pi_ref) that ref_kl/mean reports."""
    delta = (ref_logprobs.detach() - logp.detach()).double()
    return delta.exp() - delta - 1


def aggregation_of(config: RLLossConfig) -> str:
    """The aggregation a loss uses: loss.aggregation, unless its kind's entry has one of its
    own (fnt.config.losses: always "sequence" for gspo, whose objective is a mean over samples;
    module docstring)."""
    return rl_loss(config.kind).aggregation or config.aggregation


def per_sample(aggregation: str) -> bool:
    """Whether fnt.update divides the step's loss sum by its samples S (else by its tokens N):
    the aggregation's entry in fnt.config.losses.AGGREGATIONS."""
    entry = AGGREGATIONS.get(aggregation)
    return entry is not None and entry.per_sample


def aggregate(
    loss: Tensor, inputs: LossInputs, aggregation: str, max_new_tokens: Optional[int] = None
) -> Tensor:
    """The micro-batch's share of the step's loss before fnt.update's division by N ("token")
    or S ("sequence", "constant"): the sum of l_t, the sum over samples of their token mean, or
    the sum of l_t / max_new_tokens."""
    if aggregation == "token":
        return loss.sum()
    if aggregation == "sequence":
        weights = 1.0 / inputs.sample_token_counts().clamp_min(1.0)
        return (loss * weights[inputs.sample_ids]).sum()
    if aggregation == "constant":
        if not max_new_tokens:
            raise ValueError('loss.aggregation = "constant" divides by rollout.max_new_tokens')
        return loss.sum() / max_new_tokens
    raise ValueError(f"unknown loss.aggregation {aggregation!r}")
