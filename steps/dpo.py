"""The DPO step function (preference optimization on pairs). Side effects: `dpo_step` runs
forward/backward (and the reference policy's forward), collectives and the optimizer update on
the referents of `state.handles`; it does not log, print, checkpoint or profile. `dpo_loss` is
pure.

Both sides of every pair are packed into one row as two isolated documents (fnt.data.pairs), so
one forward per micro-batch gives every side's summed response logprob (fnt.preference); the
loss of `dpo.loss` (steps/dpo_losses.py) maps them to one value per pair, and the step's loss is
the mean over every pair of the step: the sum over all micro-batches of all ranks divided by the
global pair count (fnt.update.accumulate_gradients_ with per_sample).

The reference logprobs, for the losses that read them (all but simpo and orpo), come with the
batch when they were precomputed (dpo.precompute_reference), else from `state.handles.ref_model`
before the policy's forward: a frozen copy of dpo.ref_model (default model.name), or with LoRA
the policy itself with its adapters off (its base).

Metrics of a step, means over its pairs (fnt.preference): rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies (the share of pairs whose margin is > 0), logps/chosen and
logps/rejected (the summed response logprobs); loss/mean, loss/nan_count and optim/* come from
fnt.update, the data metrics (data/num_samples counts pairs) from the batch.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from fnt.batch import PairBatch, PairMicroBatch
from fnt.model.lm_head import TokenLogprobs
from fnt.obs.metrics import Elapsed
from fnt.preference import (
    needs_reference,
    pair_logps,
    pair_metrics,
    pair_sums,
    with_reference_logps,
)
from fnt.state import TrainState
from fnt.update import accumulate_gradients_, complete_step_, step_rng
from steps.dpo_losses import PairLoss, loss_of


def dpo_loss(
    logprobs: TokenLogprobs, mb: PairMicroBatch, config: Any, loss: PairLoss
) -> tuple[Tensor, dict[str, Tensor]]:
    """The LossFn of DPO (with the dpo section and its per-pair loss bound): the sum of the
    micro-batch's per-pair losses and the metric sums of fnt.preference.SUM_KEYS."""
    pairs = pair_logps(logprobs, mb)
    losses = loss(pairs, config)
    if tuple(losses.shape) != (mb.num_pairs,):
        raise ValueError(
            f"a preference loss must return one value per pair, shape ({mb.num_pairs},); got "
            f"{tuple(losses.shape)}"
        )
    return losses.sum(), pair_sums(pairs, config)


def dpo_step(
    state: TrainState, batch: PairBatch, loss: Optional[PairLoss] = None
) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's pairs with the loss of `state.config.dpo`, or with
    `loss(pairs, config) -> [P]` (a preference loss of your own); the metrics stay tensors."""
    batch.check()
    state.check_current()
    timer = Elapsed(state.handles.runtime.device)
    config, handles = state.config.dpo, state.handles
    runtime, chunk = handles.runtime, state.config.model.loss_chunk_tokens
    loss = loss or loss_of(config)
    with step_rng(state):
        if needs_reference(config) and any(mb.ref_logps is None for mb in batch.micro_batches):
            if handles.ref_model is None:
                raise ValueError(
                    f"dpo.loss = {config.loss!r} needs reference logprobs: the batch has none "
                    "and the state no reference model"
                )
            batch = with_reference_logps(handles.ref_model, batch, runtime, chunk)
        totals = accumulate_gradients_(
            handles.model,
            batch,
            runtime,
            lambda logprobs, mb: dpo_loss(logprobs, mb, config, loss),
            rows_of=lambda mb: mb.rows,
            chunk_tokens=chunk,
            per_sample=True,
        )
    return complete_step_(
        state,
        batch,
        totals,
        pair_metrics(totals.sums, totals.samples),
        timer.stop_(),
    )
