"""The preference losses of `dpo.loss`, one value per pair. Pure, except that resolving
`dpo.custom` imports its module.

Notation, per pair: pi_w, pi_l the policy's summed logprob of the chosen (w) and rejected (l)
response tokens, rho_w, rho_l the reference policy's, |w|, |l| their token counts (PairLogps,
fnt/preference.py), sigma the logistic function, beta = dpo.beta, eps = dpo.label_smoothing,
gamma = dpo.simpo_gamma:

    sigmoid  h = beta ((pi_w - rho_w) - (pi_l - rho_l))            DPO (Rafailov et al. 2023);
             l = -(1 - eps) log sigma(h) - eps log sigma(-h)        eps > 0: conservative DPO
    ipo      h = (pi_w - rho_w) / |w| - (pi_l - rho_l) / |l|        IPO (Azar et al. 2023), on
             l = (h - 1 / (2 beta))^2                               per-token logprobs as TRL
    simpo    h = beta (pi_w / |w| - pi_l / |l|) - gamma             SimPO (Meng et al. 2024),
             l = -(1 - eps) log sigma(h) - eps log sigma(-h)        reference-free
    orpo     m = pi / |y| (per side), log odds(m) = m - log(1 - e^m)  ORPO (Hong et al. 2024),
             l = -m_w - beta log sigma(log odds(m_w) - log odds(m_l))  reference-free; beta is
                                                                      the paper's lambda
    custom   dpo.custom = "module:function": fn(pairs: PairLogps, config) -> [P] losses

The step's loss is the mean of l over every pair of the step (all micro-batches, all ranks:
fnt.update divides the sum by the global pair count). log sigma is torch's logsigmoid and
log(1 - e^m) is log(-expm1(m)), which stay finite where the naive forms overflow or cancel.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fnt.config.losses import preference_loss
from fnt.config.references import import_function
from fnt.preference import PairLogps

PairLoss = Callable[[PairLogps, Any], Tensor]
"""(the micro-batch's PairLogps, the dpo section) -> per-pair losses [P], differentiable."""


def _smoothed_logistic(h: Tensor, eps: float) -> Tensor:
    """-(1 - eps) log sigma(h) - eps log sigma(-h)."""
    return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)


def sigmoid_loss(pairs: PairLogps, config: Any) -> Tensor:
    ref_chosen, ref_rejected = pairs.require_reference()
    h = config.beta * ((pairs.chosen - ref_chosen) - (pairs.rejected - ref_rejected))
    return _smoothed_logistic(h, config.label_smoothing)


def ipo_loss(pairs: PairLogps, config: Any) -> Tensor:
    ref_chosen, ref_rejected = pairs.require_reference()
    h = (pairs.chosen - ref_chosen) / pairs.chosen_tokens - (
        pairs.rejected - ref_rejected
    ) / pairs.rejected_tokens
    return (h - 1 / (2 * config.beta)) ** 2


def simpo_loss(pairs: PairLogps, config: Any) -> Tensor:
    h = config.beta * (pairs.chosen_mean - pairs.rejected_mean) - config.simpo_gamma
    return _smoothed_logistic(h, config.label_smoothing)


def log_odds(mean_logp: Tensor) -> Tensor:
    """log(p / (1 - p)) of p = exp(mean_logp) < 1."""
    return mean_logp - torch.log(-torch.expm1(mean_logp))


def orpo_loss(pairs: PairLogps, config: Any) -> Tensor:
    ratio = log_odds(pairs.chosen_mean) - log_odds(pairs.rejected_mean)
    return -pairs.chosen_mean - config.beta * F.logsigmoid(ratio)


LOSSES: dict[str, PairLoss] = {
    "sigmoid": sigmoid_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
    "orpo": orpo_loss,
}
"""The functions of the built-in losses by their `dpo.loss` name: every entry of
fnt.config.losses.PREFERENCE_LOSSES but the custom one, whose function `dpo.custom` names."""


def loss_of(config: Any) -> PairLoss:
    """The per-pair loss of the dpo section: a built-in kind, or dpo.custom's function."""
    if preference_loss(config.loss).custom:
        return import_function(config.custom, 2)
    return LOSSES[config.loss]
