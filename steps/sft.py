"""The SFT step function. Side effects: forward/backward, collectives and the optimizer update
on the referents of `state.handles`; it does not log, print, checkpoint or profile.

Loss: token-level cross entropy summed over the loss tokens of every micro-batch on every rank,
divided by the GLOBAL number of loss tokens of the step (fnt.update.accumulate_gradients_).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from fnt.batch import PackedRows, SftBatch
from fnt.state import TrainState
from fnt.update import accumulate_gradients_, complete_step_


def token_loss_sum(logits: Tensor, rows: PackedRows) -> Tensor:
    """Sum of cross entropy over the loss tokens (logits at t-1 predict the token at t)."""
    targets = rows.input_ids[:, 1:]
    mask = rows.loss_mask[:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none"
    )
    return (losses * mask.flatten()).sum()


def sft_loss(logits: Tensor, rows: PackedRows) -> tuple[Tensor, dict[str, Tensor]]:
    """The LossFn of SFT: the cross-entropy sum and no extra metric sums."""
    return token_loss_sum(logits, rows), {}


def sft_step(state: TrainState, batch: SftBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches; the metrics stay tensors."""
    batch.check()
    state.check_current()
    started = time.perf_counter()
    totals = accumulate_gradients_(state.handles.model, batch, state.handles.runtime, sft_loss)
    loss_mean = totals.loss_sum / max(totals.loss_tokens, 1.0)
    return complete_step_(
        state,
        batch,
        totals,
        {"loss/perplexity": torch.exp(loss_mean)},
        time.perf_counter() - started,
    )
