"""The SFT step function. Side effects: forward/backward, collectives and the optimizer update
on the referents of `state.handles`; it does not log, print, checkpoint or profile.

Loss: token-level cross entropy summed over the loss tokens of every micro-batch on every rank,
divided by the GLOBAL number of loss tokens of the step (fnt.update.accumulate_gradients_). The
cross entropy of a token is -log softmax(logits)[token], in float32, computed by the LM head in
chunks of `model.loss_chunk_tokens` loss tokens (fnt/model/lm_head.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fnt.batch import PackedRows, SftBatch
from fnt.model.lm_head import TokenLogprobs
from fnt.obs.metrics import Elapsed
from fnt.state import TrainState
from fnt.update import accumulate_gradients_, complete_step_, step_rng


def sft_loss(logprobs: TokenLogprobs, rows: PackedRows) -> tuple[Tensor, dict[str, Tensor]]:
    """The LossFn of SFT: the cross-entropy sum over the loss tokens, no extra metric sums."""
    return -logprobs.logp.sum(), {}


def sft_step(state: TrainState, batch: SftBatch) -> tuple[TrainState, dict]:
    """One optimizer update over this rank's micro-batches; the metrics stay tensors."""
    batch.check()
    state.check_current()
    timer = Elapsed(state.handles.runtime.device)
    with step_rng(state):
        totals = accumulate_gradients_(
            state.handles.model,
            batch,
            state.handles.runtime,
            sft_loss,
            chunk_tokens=state.config.model.loss_chunk_tokens,
        )
    loss_mean = totals.loss_sum / max(totals.loss_tokens, 1.0)
    return complete_step_(
        state,
        batch,
        totals,
        {"loss/perplexity": torch.exp(loss_mean)},
        timer.stop_(),
    )
