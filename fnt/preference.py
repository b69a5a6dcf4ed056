"""The per-pair quantities of preference optimization, which the DPO step (steps/dpo.py), the
held-out evaluation of pairs and the precomputed reference share.
Side effects: `reference_sums` and `with_reference_logps` run forward passes (collectives
under FSDP2); the rest is pure. The held-out pairs and the precomputed reference table, which
read data and run whole passes over it, are fnt.evaluation.pairs' (`PairEvalData`,
`reference_table`).

Per micro-batch of P pairs, each side's logprob is the SUM over its response tokens (the loss
tokens of its document) of log softmax(logits[t-1])[x_t] in float32, the same chunked LM head
as SFT's loss (fnt/lm_head.py); its token count is how many response tokens it has. The
reference logprobs are the same sums under the reference policy, without gradient: a frozen
copy (handles.ref_model), the LoRA policy with its adapters off (its base), or a table computed
once before step 1 (dpo.precompute_reference).

Rewards, as TRL reports them: beta * (logp - ref_logp) per side for the sigmoid and custom
losses; the same with both logprobs divided by the side's token count for ipo; beta times the
mean logprob per token for the reference-free simpo and orpo. The margin is chosen minus
rejected reward, and a pair counts as accurate when its margin is > 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from fnt.batch import PairBatch, PairMicroBatch, row_layout, to_device
from fnt.config.losses import PREFERENCE_LOSSES, names_where
from fnt.distributed.runtime import Runtime
from fnt.model.lm_head import TokenLogprobs, at_loss_tokens, loss_tokens_of
from fnt.model.lora import adapters_disabled
from fnt.update import forward_loss_tokens, micro_batches_to_run

REFERENCE_FREE = names_where(PREFERENCE_LOSSES, "reference_free")
"""The dpo.loss kinds that need no reference policy (fnt.config.losses: simpo, orpo)."""

# The metric sums over pairs; every key is sent by every rank (one stacked all-reduce).
SUM_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def needs_reference(config: Any) -> bool:
    """Whether the dpo section's loss reads reference logprobs (every kind but simpo, orpo)."""
    return config.loss not in REFERENCE_FREE


@dataclass(frozen=True)
class PairLogps:
    """What a preference loss sees of P pairs: each side's summed response logprob under the
    policy (differentiable) and the reference (None when the loss needs none), and its response
    token count."""

    chosen: Tensor  # [P] float32
    rejected: Tensor  # [P] float32
    chosen_tokens: Tensor  # [P] float32, >= 1
    rejected_tokens: Tensor  # [P] float32, >= 1
    ref_chosen: Optional[Tensor] = None  # [P] float32, no gradient
    ref_rejected: Optional[Tensor] = None  # [P] float32, no gradient

    @property
    def chosen_mean(self) -> Tensor:
        """The chosen side's mean logprob per response token."""
        return self.chosen / self.chosen_tokens

    @property
    def rejected_mean(self) -> Tensor:
        return self.rejected / self.rejected_tokens

    def require_reference(self) -> tuple[Tensor, Tensor]:
        """(ref_chosen, ref_rejected); ValueError when the pairs carry no reference."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("this loss needs reference logprobs, and the pairs carry none")
        return self.ref_chosen, self.ref_rejected


def sequence_sums(logp: Tensor, mb: PairMicroBatch) -> tuple[Tensor, Tensor]:
    """([P, 2] summed logp, [P, 2] token counts) of each side (chosen, rejected) of the
    micro-batch's pairs, from the logprobs of its loss tokens (in LossTokens order)."""
    sequence = at_loss_tokens(mb.rows, mb.sequence_ids)
    size = 2 * mb.num_pairs
    sums = logp.new_zeros(size).index_add(0, sequence, logp)
    counts = torch.zeros(size, device=logp.device).index_add(
        0, sequence, torch.ones_like(logp, dtype=torch.float32)
    )
    return sums.view(mb.num_pairs, 2), counts.view(mb.num_pairs, 2)


def pair_logps(logprobs: TokenLogprobs, mb: PairMicroBatch) -> PairLogps:
    """The micro-batch's PairLogps: the policy's from `logprobs`, the reference's from
    mb.ref_logps (when set)."""
    sums, counts = sequence_sums(logprobs.logp, mb)
    ref = mb.ref_logps
    return PairLogps(
        chosen=sums[:, 0],
        rejected=sums[:, 1],
        chosen_tokens=counts[:, 0],
        rejected_tokens=counts[:, 1],
        ref_chosen=None if ref is None else ref[:, 0].to(sums.dtype),
        ref_rejected=None if ref is None else ref[:, 1].to(sums.dtype),
    )


def pair_rewards(pairs: PairLogps, config: Any) -> tuple[Tensor, Tensor]:
    """The detached (chosen, rejected) rewards [P] of the dpo section's loss (module
    docstring)."""
    with torch.no_grad():
        if config.loss in REFERENCE_FREE:
            return config.beta * pairs.chosen_mean, config.beta * pairs.rejected_mean
        ref_chosen, ref_rejected = pairs.require_reference()
        chosen, rejected = pairs.chosen - ref_chosen, pairs.rejected - ref_rejected
        if PREFERENCE_LOSSES[config.loss].per_token_rewards:  # ipo
            chosen, rejected = chosen / pairs.chosen_tokens, rejected / pairs.rejected_tokens
        return config.beta * chosen, config.beta * rejected


def pair_sums(pairs: PairLogps, config: Any) -> dict[str, Tensor]:
    """The sums over the pairs of SUM_KEYS (detached)."""
    chosen, rejected = pair_rewards(pairs, config)
    margins = chosen - rejected
    return {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/margins": margins.sum(),
        "rewards/accuracies": (margins > 0).float().sum(),
        "logps/chosen": pairs.chosen.detach().sum(),
        "logps/rejected": pairs.rejected.detach().sum(),
    }


def pair_metrics(sums: dict[str, Tensor], num_pairs: float) -> dict[str, Tensor]:
    """The means over pairs of the summed SUM_KEYS (NaN for keys a step has no sum of)."""
    nan = torch.tensor(float("nan"))
    return {key: sums.get(key, nan) / max(num_pairs, 1.0) for key in SUM_KEYS}


# ---------------------------------------------------------------------------------------------
# The reference policy's logprobs


def reference_sums(model: nn.Module, mb: PairMicroBatch, chunk_tokens: int) -> Tensor:
    """[P, 2] float32: each side's summed response logprob under `model` with any LoRA adapters
    off (a frozen copy, or the policy's base), without gradient."""
    with torch.no_grad():
        tokens = loss_tokens_of(mb.rows)
        with adapters_disabled(model):
            _, logprobs = forward_loss_tokens(model, mb.rows, tokens, chunk_tokens)
        if hasattr(model, "reshard"):  # FSDP2 keeps the root unsharded after a forward
            model.reshard()
        return sequence_sums(logprobs.logp.float(), mb)[0]


def with_reference_logps(
    ref_model: nn.Module, batch: PairBatch, runtime: Runtime, chunk_tokens: int
) -> PairBatch:
    """The batch with every micro-batch's ref_logps [P, 2] from `ref_model` (on the device).

    Runs the micro-batches `accumulate_gradients_` will run (the same count on every rank, as
    FSDP2 needs); trailing ones without a loss token on any rank get zeros."""
    counts = [row_layout(mb.rows).num_loss_tokens for mb in batch.micro_batches]
    to_run = micro_batches_to_run(counts, runtime)
    out = []
    for i, mb in enumerate(batch.micro_batches):
        mb = to_device(mb, runtime.device)
        if i < to_run:
            ref = reference_sums(ref_model, mb, chunk_tokens)
        else:
            ref = torch.zeros(mb.num_pairs, 2, device=runtime.device)
        out.append(dataclasses.replace(mb, ref_logps=ref))
    return dataclasses.replace(batch, micro_batches=tuple(out))
