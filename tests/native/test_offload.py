"""Offload: the plan for each mode, NUMA parsing, and SFT with the CPU AdamW in every mode."""

from __future__ import annotations

import os

import pytest
import torch

from fnt.batch import DataPosition, SftBatch
from fnt.build import save_state_
from fnt.config import Config, ConfigError, ModelConfig, OptimConfig
from fnt.data.synthetic import synthetic_rows, take_rows
from fnt.distributed.runtime import setup_trainer
from fnt.loop import fold
from fnt.optim.adamw import CPUAdamW
from fnt.optim.offload import node_cpus, numa_binding, numa_node_of, parse_cpulist
from fnt.optim.setup import NO_OFFLOAD, fp32_module_names, offload_plan
from fnt.start import start_state
from steps.sft import sft_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
STEPS = 20


# The plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["state", "full"])
def test_offload_needs_the_cpu_adamw(mode):
    with pytest.raises(ConfigError, match=r"optim\.offload.*optim\.impl"):
        offload_plan(OptimConfig(impl="torch", offload=mode), CPU, distributed=True)


def test_cpu_adamw_on_cuda_params_needs_offload():
    with pytest.raises(ConfigError, match='optim.offload to "state" or "full"'):
        offload_plan(OptimConfig(impl="native"), CUDA, distributed=True)


@pytest.mark.parametrize("mode", ["state", "full"])
def test_a_single_cuda_process_cannot_offload(mode):
    with pytest.raises(ConfigError, match="torchrun"):
        offload_plan(OptimConfig(impl="native", offload=mode), CUDA, distributed=False)


def test_plans_of_each_mode():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    none = offload_plan(OptimConfig(impl="native"), CPU, distributed=True)
    assert none.offload_policy is None and none.mp_policy is None and not none.cast_params

    for device, distributed in [(CPU, False)]:
        state = offload_plan(OptimConfig(impl="native", offload="state"), device, distributed)
        assert state == none  # one CPU process: the state is on the CPU already
        full = offload_plan(
            OptimConfig(impl="native", offload="full", keep_fp32=("mlp.gate",)), device, distributed
        )
        assert full.cast_params and full.compute_dtype == torch.bfloat16
        assert full.keep_fp32 == ("mlp.gate",) and full.offload_policy is None
        fp32 = offload_plan(
            OptimConfig(impl="native", offload="full", offload_dtype="float32"), device, distributed
        )
        assert not fp32.cast_params

    for device, pinned in [(CPU, False), (CUDA, True)]:
        state = offload_plan(OptimConfig(impl="reference", offload="state"), device, True)
        assert isinstance(state.offload_policy, CPUOffloadPolicy)
        assert state.offload_policy.pin_memory is pinned and state.mp_policy is None
        assert state.bind_numa is pinned
        full = offload_plan(OptimConfig(impl="native", offload="full"), device, True)
        assert full.mp_policy == MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        assert full.offload_policy.pin_memory is pinned and not full.cast_params


def test_bf16_compute_without_offload_is_fsdp2_mixed_precision_or_autocast():
    distributed = offload_plan(OptimConfig(), CPU, True, compute_dtype="bfloat16")
    assert distributed.offload_policy is None and not distributed.bind_numa
    assert distributed.mp_policy.param_dtype == torch.bfloat16
    assert distributed.mp_policy.reduce_dtype == torch.float32
    single = offload_plan(OptimConfig(), CPU, False, compute_dtype="bfloat16")
    assert single.autocast and single.compute_dtype == torch.bfloat16 and not single.cast_params
    assert offload_plan(OptimConfig(), CPU, False) == NO_OFFLOAD
    full = OptimConfig(impl="native", offload="full", offload_dtype="float32")
    with pytest.raises(ConfigError, match="'model.compute_dtype' = 'bfloat16' but full offload"):
        offload_plan(full, CPU, True, compute_dtype="bfloat16")


def test_keep_fp32_units_are_the_owning_modules():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.bias",
    ]
    assert fp32_module_names(names, ("mlp.gate.",)) == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    assert fp32_module_names(names, ()) == []


# NUMA -------------------------------------------------------------------------------------


def test_parse_cpulist():
    assert parse_cpulist("0-3,8-9,12\n") == frozenset({0, 1, 2, 3, 8, 9, 12})
    assert parse_cpulist("\n") == frozenset()


def fake_sysfs(root, gpu_nodes: dict[str, str], node_lists: dict[int, str]):
    for bus_id, node in gpu_nodes.items():
        path = root / "bus" / "pci" / "devices" / bus_id
        path.mkdir(parents=True)
        (path / "numa_node").write_text(node + "\n")
    for node, cpulist in node_lists.items():
        path = root / "devices" / "system" / "node" / f"node{node}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpulist + "\n")
    return root


def test_numa_binding_from_a_fake_sysfs(tmp_path):
    gpus = ["0000:17:00.0", "0000:2a:00.0", "0000:9b:00.0", "0000:c1:00.0"]
    sysfs = fake_sysfs(tmp_path, dict(zip(gpus, ["0", "0", "1", "-1"])), {0: "0-7", 1: "8-15"})
    assert numa_node_of(sysfs, "0000:9B:00.0") == 1
    assert numa_node_of(sysfs, gpus[3]) is None
    assert numa_node_of(sysfs, "0000:ff:00.0") is None
    assert node_cpus(sysfs, 1) == frozenset(range(8, 16)) and node_cpus(sysfs, 5) == frozenset()

    allowed = frozenset(range(14))  # a container that hides two of node 1's CPUs
    assert numa_binding(sysfs, gpus, 0, allowed) == (frozenset(range(8)), 2)
    assert numa_binding(sysfs, gpus, 2, allowed) == (frozenset(range(8, 14)), 1)
    # Unknown node: every local rank shares what the process may use.
    assert numa_binding(sysfs, gpus, 3, allowed) == (allowed, 4)
    # None of the node's CPUs allowed: no binding to an empty set.
    assert numa_binding(sysfs, gpus, 2, frozenset(range(4))) == (frozenset(range(4)), 4)


@pytest.mark.gpu
def test_bind_numa_pins_the_rank_to_its_gpus_node():
    from fnt.optim.offload import SYSFS, bind_numa_, pci_bus_id

    before = os.sched_getaffinity(0)
    try:
        sharing = bind_numa_(0, 1)
        node = numa_node_of(SYSFS, pci_bus_id(0))
        expected = before if node is None else (node_cpus(SYSFS, node) & before or before)
        assert os.sched_getaffinity(0) == expected
        assert sharing == 1  # one local rank: the whole node is its share
    finally:
        os.sched_setaffinity(0, before)


# SFT in every mode, in one process ----------------------------------------------------------


def make_state(model_dir, out, resume=None, **optim):
    config = Config(
        model=ModelConfig(name=str(model_dir)),
        optim=OptimConfig(lr=3e-3, max_norm=1.0, **optim),
        max_steps=STEPS,
        seq_len=32,
        output_dir=str(out),
        resume=resume,
    )
    return start_state(config, setup_trainer(config))


def fixed_source(state):
    rows, docs = synthetic_rows(seed=0, step=state.progress.step + 1, num_rows=4, seq_len=32)
    micro = (take_rows(rows, 0, 2), take_rows(rows, 2, 4))
    return SftBatch(micro_batches=micro, num_samples=sum(docs), data_after=DataPosition())


def train(state, first: int, last: int):
    assert state.progress.step == first - 1
    losses = []
    for state, metrics in fold(state, fixed_source, sft_step, last - first + 1):
        losses.append(float(metrics["loss/mean"]))
    return state, losses


@pytest.fixture(scope="module")
def torch_losses(tiny_model_dir, tmp_path_factory):
    return train(make_state(tiny_model_dir, tmp_path_factory.mktemp("torch")), 1, STEPS)[1]


@pytest.mark.parametrize(
    "optim",
    [
        dict(impl="native"),
        dict(impl="reference"),
        dict(impl="native", offload="state"),
        dict(impl="native", offload="full", offload_dtype="float32"),
    ],
    ids=["native", "reference", "state", "full-fp32"],
)
def test_cpu_adamw_matches_torch_in_float32(tiny_model_dir, tmp_path, torch_losses, optim):
    state = make_state(tiny_model_dir, tmp_path, **optim)
    assert isinstance(state.handles.optimizer, CPUAdamW)
    _, losses = train(state, 1, STEPS)
    assert losses == pytest.approx(torch_losses, abs=1e-5, rel=0)


def test_full_offload_in_bfloat16_trains(tiny_model_dir, tmp_path, torch_losses):
    state = make_state(tiny_model_dir, tmp_path, impl="native", offload="full")
    model, optimizer = state.handles.model, state.handles.optimizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state, losses = train(state, 1, STEPS)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.75 * losses[0], losses
    # Lower precision than float32, but the same training: close to the float32 losses.
    assert losses == pytest.approx(torch_losses, abs=0.1)
    for p in model.parameters():
        master = optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))


def test_keep_fp32_routers_stay_float32_and_train(tiny_moe_dir, tmp_path):
    keep = ("mlp.gate.",)
    state = make_state(tiny_moe_dir, tmp_path, impl="native", offload="full", keep_fp32=keep)
    model = state.handles.model
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert any(".mlp.gate." in name for name in dtypes)
    assert all(
        (dtype == torch.float32) == any(k in name for k in keep) for name, dtype in dtypes.items()
    ), dtypes
    _, losses = train(state, 1, 3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_resume_across_offload_modes_keeps_the_float32_weights(tiny_model_dir, tmp_path):
    # full (bf16 params, fp32 masters) for 3 steps, saved...
    full = make_state(tiny_model_dir, tmp_path, impl="native", offload="full")
    full, _ = train(full, 1, 3)
    save_state_(full)
    masters = {
        name: full.handles.optimizer.state[p]["master"].clone()
        for name, p in full.handles.model.named_parameters()
    }
    moments = {
        name: full.handles.optimizer.state[p]["exp_avg_sq"].clone()
        for name, p in full.handles.model.named_parameters()
    }

    # ...resumes without offload: the float32 weights are the masters, bit for bit...
    plain = make_state(tiny_model_dir, tmp_path, resume="latest", impl="native")
    assert plain.progress.step == 3
    for name, p in plain.handles.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[name]), name
        st = plain.handles.optimizer.state[p]
        assert "master" not in st and torch.equal(st["exp_avg_sq"], moments[name]), name
    plain, _ = train(plain, 4, 5)
    save_state_(plain)
    weights = {n: p.detach().clone() for n, p in plain.handles.model.named_parameters()}

    # ...and back to full: masters primed from the float32 weights, params rounded from them.
    again = make_state(tiny_model_dir, tmp_path, resume="latest", impl="native", offload="full")
    assert again.progress.step == 5
    for name, p in again.handles.model.named_parameters():
        master = again.handles.optimizer.state[p]["master"]
        assert torch.equal(master, weights[name]), name
        assert torch.equal(p, weights[name].to(torch.bfloat16)), name
    _, losses = train(again, 6, 7)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_load_state_dict_copies_a_saved_master_into_a_float32_param():
    torch.manual_seed(0)
    low = torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16))
    opt = CPUAdamW([low], lr=1e-2)
    low.grad = torch.randn(5, 3).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    master = opt.state[low]["master"].clone()
    assert not torch.equal(master, low.detach().float())  # the master holds more bits

    fp32 = torch.nn.Parameter(low.detach().float())
    opt2 = CPUAdamW([fp32], lr=1e-2)
    opt2.load_state_dict(sd)
    assert torch.equal(fp32.detach(), master) and "master" not in opt2.state[fp32]
