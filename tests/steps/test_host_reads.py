"""A step reads nothing back from the device: SFT, RL and DPO steps, in one process, make no
torch op whose result the host must wait for (a value read with .item()/bool()/int(), a
nonzero, a boolean-mask index, a unique, a device-to-host copy), however many micro-batches,
documents and layers; the metrics' one transfer is the driver's (fnt.obs.metrics.to_floats).

On a CPU every tensor is a host tensor, so the count is of the ops themselves; the batch's own
checks and layout read the host batch through numpy (fnt.batch.host_array), which costs a device
nothing. On a GPU the gpu-marked test runs the steps under torch.cuda.set_sync_debug_mode
("error"), which raises at the first synchronizing call.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fnt import init_state
from fnt.config import Config, ModelConfig, OptimConfig, RLLossConfig
from fnt.data.synthetic import synthetic_rows
from fnt.distributed.runtime import setup_trainer
from fnt.sources import pair_source
from steps import dpo_step
from steps.rl import rl_step
from steps.sft import sft_step
from tests.steps import test_dpo as dpo
from tests.steps import test_rl_step as rl
from tests.steps.test_sft import batch_of, make_state

aten = torch.ops.aten
# Ops whose result (a value, or an output size) the host needs: each waits for the device.
READ_BACK = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.equal.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
BOOLEAN_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for the device, with where they were called."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reads_back(func, args, kwargs, out):
            frames = [
                f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename
            ]
            place = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.found[f"{func} at {place}"] += 1
        return out

    @staticmethod
    def reads_back(func, args, kwargs, out) -> bool:
        if func in READ_BACK:
            return True
        if func in BOOLEAN_INDEXING:
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in COPIES:  # device to host
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0] if func is aten.copy_.default else out
            return source.device.type != "cpu" and target.device.type == "cpu"
        return False

    @property
    def total(self) -> int:
        return sum(self.found.values())


def test_the_counter_sees_each_kind_of_read():
    t = torch.arange(6.0)
    with HostReads() as reads:
        float(t.sum())
        bool(t.any())
        t[t > 2]
        t.nonzero()
        torch.unique(t)
    assert reads.total == 5, reads.found


def step_reads(step_fn, state, batch) -> collections.Counter:
    """The reads of the second step (the first one creates the optimizer's state)."""
    state, _ = step_fn(state, batch)
    with HostReads() as reads:
        step_fn(state, batch)
    return reads.found


@pytest.mark.parametrize("micro_batch_size", [4, 1])
@pytest.mark.parametrize("chunk", [1024, 0])
def test_an_sft_step_reads_nothing_back(tiny_model_dir, micro_batch_size, chunk):
    state = make_state(tiny_model_dir)
    model = dataclasses.replace(state.config.model, loss_chunk_tokens=chunk)
    state = dataclasses.replace(state, config=dataclasses.replace(state.config, model=model))
    rows, docs = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    assert sum(docs) > 4  # several documents a row
    assert step_reads(sft_step, state, batch_of(rows, micro_batch_size)) == {}


@pytest.mark.parametrize("size", [rl.ROWS, 1])
@pytest.mark.parametrize("kind", ["dppo_tv", "gspo"])
def test_an_rl_step_reads_nothing_back(tiny_model_dir, size, kind):
    state = rl.make_state(tiny_model_dir, loss=RLLossConfig(kind=kind))
    rows = rl.random_rows(0)
    batch = rl.rl_batch(rows, rl.own_logprobs(state.handles.model, rows), size=size)
    assert step_reads(rl_step, state, batch) == {}


def test_a_dpo_step_reads_nothing_back(tiny_model_dir, tmp_path):
    state = dpo.make_state(dpo.dpo_config(tiny_model_dir, tmp_path))
    batch = pair_source(state)
    assert len(batch.micro_batches) == 2
    assert step_reads(dpo_step, state, batch) == {}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "compute_dtype, kernel", [("bfloat16", "auto"), ("float32", "auto"), ("float32", "sdpa")]
)
def test_steps_on_a_gpu_never_synchronize(tiny_model_dir, tmp_path, compute_dtype, kernel):
    """The second step of each kind under torch.cuda.set_sync_debug_mode("error"): bfloat16
    compute takes the varlen kernel ("auto", compiled), float32 FlexAttention ("auto") or sdpa
    with the block mask (eager, to keep the GPU check's part short)."""
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    model = ModelConfig(
        name=str(tiny_model_dir),
        compute_dtype=compute_dtype,
        attn_implementation=kernel,
        compile="auto" if compute_dtype == "bfloat16" else False,
    )
    rows, _ = synthetic_rows(seed=0, step=1, num_rows=4, seq_len=32)
    sft_config = Config(model=model, optim=OptimConfig(lr=3e-3, max_norm=1.0), seq_len=32)
    sft_state = init_state(sft_config, setup_trainer(sft_config))
    rl_state = rl.make_state(tiny_model_dir)
    rl_batch = rl.rl_batch(rl.random_rows(0), None, size=1)
    dpo_config = dataclasses.replace(dpo.dpo_config(tiny_model_dir, tmp_path), model=model)
    dpo_state = dpo.make_state(dpo_config)
    for step_fn, state, batch in (
        (sft_step, sft_state, batch_of(rows, 1)),
        (rl_step, rl_state, rl_batch),
        (dpo_step, dpo_state, pair_source(dpo_state)),
    ):
        state, _ = step_fn(state, batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step_fn(state, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
