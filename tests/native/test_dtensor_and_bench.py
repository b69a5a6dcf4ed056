"""End-to-end runs in subprocesses: DTensor params on a one-rank gloo mesh, and the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# One rank is enough to take the DTensor path (to_local views, DTensor state, DCP with DTensor
# values); a subprocess keeps the process group out of the test session.
DTENSOR_SCRIPT = textwrap.dedent(
    """
    import copy
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from fnt.optim.adamw import CPUAdamW

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def model(dtype, shard):
        torch.manual_seed(0)
        m = torch.nn.Linear(12, 8).to(dtype)
        if shard:
            for name, p in list(m.named_parameters()):
                dp = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
                setattr(m, name, dp)
        return m

    def train(m, opt, steps):
        for k in steps:
            p0 = next(m.parameters())
            for p in m.parameters():
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).to(p.dtype)
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if isinstance(p, DTensor) else g
            opt.step()
            opt.zero_grad()

    for dtype in (torch.float32, torch.bfloat16):
        plain = model(dtype, shard=False)
        train(plain, CPUAdamW(plain.parameters(), lr=1e-2), range(6))

        m = model(dtype, shard=True)
        opt = CPUAdamW(m.parameters(), lr=1e-2)
        train(m, opt, range(3))
        state = opt.state[m.weight]
        assert all(isinstance(state[k], DTensor) for k in state if k != "step"), state
        osd = copy.deepcopy(get_optimizer_state_dict(m, opt))
        assert isinstance(osd["state"]["weight"]["exp_avg"], DTensor)

        m2 = model(dtype, shard=True)
        m2.load_state_dict(m.state_dict())
        opt2 = CPUAdamW(m2.parameters(), lr=1e-2)
        set_optimizer_state_dict(m2, opt2, osd)
        train(m2, opt2, range(3, 6))
        for a, b in zip(plain.parameters(), m2.parameters()):
            assert torch.equal(a, b.full_tensor()), (dtype, a, b)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_dtensor_params_match_plain_params_and_round_trip_through_dcp():
    out = subprocess.run(
        [sys.executable, "-c", DTENSOR_SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


def test_bench_quick_prints_the_ratios_as_its_last_line():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_adamw.py"), "--quick", "--reps", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "fp32_vs_torch_fused",
        "many_small_vs_torch_fused",
        "mixed_vs_torch_composite",
        "fp32_fraction_of_probe",
    ):
        assert result[key] > 0
    assert set(result["median_ms"]) == {"fp32_1x50M", "fp32_5000x10K", "bf16_1x50M"}
    assert result["median_ms"]["fp32_1x50M"].keys() >= {"native", "torch_fused", "probe"}
