"""Lower-precision compute over float32 masters in one process (autocast) casts each master
once a step: not once a micro-batch, nor again in each recomputed loss chunk; and keeping the
casts for the step changes no number."""

from __future__ import annotations

import collections
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fnt.update
from fnt import init_state
from fnt.config import Config, ModelConfig, OptimConfig
from fnt.data.synthetic import synthetic_rows
from fnt.distributed.runtime import setup_trainer
from fnt.update import accumulate_gradients_
from steps.sft import sft_loss
from tests.steps.test_sft import batch_of


class ParameterCasts(TorchDispatchMode):
    """Counts the dtype casts (aten._to_copy) of each parameter of `model`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {p.data_ptr(): n for n, p in model.named_parameters()}
        self.casts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        if func is torch.ops.aten._to_copy.default and source.data_ptr() in self.names:
            self.casts[self.names[source.data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_each_master_is_cast_once_a_step_and_the_kept_casts_change_nothing(
    tiny_tied_dir, micro_batch_size, monkeypatch
):
    # Chunks of 16 loss tokens: a micro-batch's head runs in several chunks, all but the last
    # recomputed in backward.
    model_config = ModelConfig(
        name=str(tiny_tied_dir), compute_dtype="bfloat16", loss_chunk_tokens=16
    )
    config = Config(model=model_config, optim=OptimConfig(lr=1e-3), seq_len=32)
    runtime = setup_trainer(config)
    model = init_state(config, runtime).handles.model
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    batch = batch_of(rows, micro_batch_size)

    def step():
        model.zero_grad(set_to_none=True)
        totals = accumulate_gradients_(model, batch, runtime, sft_loss, chunk_tokens=16)
        return totals.loss_sum, [p.grad.clone() for p in model.parameters()]

    with ParameterCasts(model) as mode:
        kept = step()
    trained = [n for n, p in model.named_parameters() if p.ndim == 2]
    assert mode.casts == {name: 1 for name in trained}, mode.casts
    # Each micro-batch's forward casting anew (autocast's own regions alone) casts more...
    monkeypatch.setattr(fnt.update, "casts_kept_for_the_step", lambda runtime: nullcontext())
    with ParameterCasts(model) as mode:
        anew = step()
    assert max(mode.casts.values()) > 1
    # ... and gives the same numbers, bit for bit.
    assert torch.equal(kept[0], anew[0])
    assert all(torch.equal(a, b) for a, b in zip(kept[1], anew[1]))
