"""CPUAdamW (native kernel and reference) against torch.optim.AdamW and against each other."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fnt.optim.adamw import CPUAdamW

pytestmark = pytest.mark.numerics


def assert_within_rounding(ours, theirs, steps: int, scale: float) -> None:
    """`ours` equals `theirs` up to one float32 rounding per step at the values' scale:
    |ours - theirs| <= steps * 2**-23 * (|theirs| + scale).

    The native kernel and torch's fused AdamW compute the same formula; they differ only where
    one contracts a multiply-add into an FMA and the other does not. Under avx2 and avx512 torch
    does, like the native kernel, and both are bit-identical (measured: 300 random cases of 100
    steps). Torch's ATEN_CPU_CAPABILITY=default build does not: the same cases then differ by
    at most 0.38 of this bound for the parameters (scale = lr: an update is about lr) and 0.03
    for the moments (scale = the moment's largest value).
    """
    bound = steps * 2.0**-23 * (theirs.abs() + scale)
    excess = (ours - theirs).abs() - bound
    assert excess.max() <= 0, f"{float((ours - theirs).abs().max())} beyond the rounding bound"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors: torch's fused AdamW forks threads per tensor, which on a busy machine costs
    milliseconds per step and decides nothing here (it splits at cache-line boundaries, so the
    result does not depend on the thread count). Multithreading has its own test below."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


shapes_st = st.lists(
    st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
)
hyper_st = st.fixed_dictionaries(
    {
        "lr": st.floats(1e-4, 1e-1),
        "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999)),
        "eps": st.floats(1e-10, 1e-3),
        "weight_decay": st.floats(0.0, 0.5),
    }
)


def grad_stream(shapes, steps: int, seed: int, dtype=torch.float32) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


def make_params(shapes, seed: int, dtype=torch.float32, grad_dtype=None) -> list[torch.Tensor]:
    """Leaf params; ``grad_dtype`` lets torch accept grads of another dtype than the param's."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    for p in params:
        p.grad_dtype = grad_dtype or dtype
    return params


def run_(opt: torch.optim.Optimizer, params, grads, lrs=None) -> None:
    for k, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[k]
        opt.step()


@pytest.mark.parametrize("impl", ["native", "reference"])
@settings(max_examples=25, deadline=None)
@given(shapes=shapes_st, hyper=hyper_st, seed=st.integers(0, 2**16))
def test_matches_torch_fused_adamw_over_100_steps(impl, shapes, hyper, seed):
    grads = grad_stream(shapes, 100, seed)
    ours, theirs = make_params(shapes, seed), make_params(shapes, seed)
    opt = CPUAdamW(ours, impl=impl, **hyper)
    ref = torch.optim.AdamW(theirs, fused=True, **hyper)
    run_(opt, ours, grads)
    run_(ref, theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert_within_rounding(a.detach(), b.detach(), 100, hyper["lr"])
        for key in ("exp_avg", "exp_avg_sq"):
            moment = ref.state[b][key]
            assert_within_rounding(opt.state[a][key], moment, 100, float(moment.abs().max()))
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 100


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_lr_changing_every_step_matches_torch(impl):
    shapes = [(37,), (8, 9)]
    grads = grad_stream(shapes, 30, seed=1)
    lrs = [1e-2 * (k + 1) / 30 for k in range(30)]
    ours, theirs = make_params(shapes, 1), make_params(shapes, 1)
    opt = CPUAdamW(ours, lr=1.0, impl=impl)
    ref = torch.optim.AdamW(theirs, lr=1.0, fused=True)
    run_(opt, ours, grads, lrs)
    run_(ref, theirs, grads, lrs)
    for a, b in zip(ours, theirs, strict=True):
        assert_within_rounding(a.detach(), b.detach(), 30, max(lrs))


def test_param_groups_use_their_own_hyperparameters():
    shapes = [(50,), (20,)]
    grads = grad_stream(shapes, 10, seed=2)
    ours, theirs = make_params(shapes, 2), make_params(shapes, 2)
    groups = lambda ps: [  # noqa: E731
        {"params": [ps[0]], "lr": 3e-2, "weight_decay": 0.0},
        {"params": [ps[1]], "betas": (0.5, 0.9)},
    ]
    opt = CPUAdamW(groups(ours))
    ref = torch.optim.AdamW(groups(theirs), fused=True)
    run_(opt, ours, grads)
    run_(ref, theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert_within_rounding(a.detach(), b.detach(), 10, 3e-2)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_grads_are_never_modified(impl, param_dtype, grad_dtype):
    params = make_params([(33, 5), (7, 3)], 3, param_dtype, grad_dtype)
    opt = CPUAdamW(params, impl=impl)
    grads = [g.to(grad_dtype) for g in grad_stream([(33, 5), (3, 7)], 1, seed=3)[0]]
    grads[1] = grads[1].t()  # a grad laid out unlike its param takes the copying path
    before = [g.clone() for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    for g, b in zip(grads, before, strict=True):
        assert g.dtype == b.dtype and g.stride() == b.stride()
        bits = torch.int16 if g.element_size() == 2 else torch.int32
        assert torch.equal(g.view(bits), b.view(bits))


def test_params_without_grad_are_skipped():
    params = make_params([(10,), (10,)], 4)
    frozen = params[1].detach().clone()
    opt = CPUAdamW(params, lr=0.1)
    params[0].grad = torch.ones(10)
    opt.step()
    assert torch.equal(params[1], frozen)
    assert params[1] not in opt.state
    assert opt.state[params[0]]["step"].item() == 1.0


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_mixed_precision_native_matches_reference_and_torch_composite(param_dtype, grad_dtype):
    shapes = [(129,), (17, 31)]
    grads = grad_stream(shapes, 20, seed=5, dtype=grad_dtype)
    native = make_params(shapes, 5, param_dtype, grad_dtype)
    reference = make_params(shapes, 5, param_dtype, grad_dtype)
    opt_n = CPUAdamW(native, lr=1e-2, impl="native")
    opt_r = CPUAdamW(reference, lr=1e-2, impl="reference")
    run_(opt_n, native, grads)
    run_(opt_r, reference, grads)

    # The torch way: fp32 grads, fused AdamW on fp32 master copies, rounded back each step.
    low = make_params(shapes, 5, param_dtype)
    masters = [p.detach().float().requires_grad_() for p in low]
    composite = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for step_grads in grads:
        for m, g in zip(masters, step_grads, strict=True):
            m.grad = g.float()
        composite.step()
        with torch.no_grad():
            for p, m in zip(low, masters, strict=True):
                p.copy_(m)

    for pn, pr, pc, mc in zip(native, reference, low, masters, strict=True):
        st_n, st_r = opt_n.state[pn], opt_r.state[pr]
        assert pn.dtype == param_dtype
        assert {k: v.dtype for k, v in st_n.items()} == {
            "step": torch.float32,
            "exp_avg": torch.float32,
            "exp_avg_sq": torch.float32,
            "master": torch.float32,
        }
        # Each param is exactly its master rounded to nearest even.
        assert torch.equal(pn, st_n["master"].to(param_dtype))
        assert torch.equal(pr, st_r["master"].to(param_dtype))
        assert_within_rounding(st_n["master"], st_r["master"], 20, 1e-2)
        for key in ("exp_avg", "exp_avg_sq"):
            moment = st_r[key]
            assert_within_rounding(st_n[key], moment, 20, float(moment.abs().max()))
        assert_within_rounding(st_n["master"], mc.detach(), 20, 1e-2)
        # Masters agree to ~1e-6, so the rounded params differ by at most one low-precision ulp.
        torch.testing.assert_close(pn.float(), pc.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_write_rounds_to_nearest_even(impl, dtype):
    one, three = torch.tensor([1.0, -3.0], dtype=dtype)
    # Mantissas ending in 0 and in 1, so ties go down for some and up for others.
    base = torch.stack(
        [one, torch.nextafter(one, 2 * one), three, torch.nextafter(three, 2 * three)]
    )
    b32 = base.float()
    gap = torch.nextafter(base, 2 * base).float() - b32
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e30])
    values = torch.cat([b32 + gap / 2, b32 + gap * 0.501, b32 + gap * 0.499, specials])
    expected = values.to(dtype)  # torch's conversion rounds to nearest even
    assert not torch.equal(expected[:4], base)  # some ties do round up

    p = torch.zeros(values.numel() + 1, dtype=dtype, requires_grad=True)
    opt = CPUAdamW([p], lr=0.0, weight_decay=0.0, impl=impl)
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.state[p]["master"].copy_(torch.cat([values, torch.tensor([float("nan")])]))
    opt.step()  # lr 0: the master is unchanged and the param is written from it
    assert torch.equal(p[:-1].view(torch.int16), expected.view(torch.int16))
    assert torch.isnan(p[-1])


def test_large_group_split_across_threads_matches_reference_and_torch():
    torch.set_num_threads(2)  # restored by the fixture
    # 120K elements in all: the work is split mid-tensor and tensors share a thread's range.
    shapes = [(70_001,), (3,), (49_996,)]
    grads = grad_stream(shapes, 3, seed=6)
    native, reference, theirs = (make_params(shapes, 6) for _ in range(3))
    run_(CPUAdamW(native, impl="native"), native, grads)
    run_(CPUAdamW(reference, impl="reference"), reference, grads)
    run_(torch.optim.AdamW(theirs, fused=True), theirs, grads)
    for a, b, c in zip(native, reference, theirs, strict=True):
        assert_within_rounding(a.detach(), b.detach(), 3, 1e-3)
        assert_within_rounding(a.detach(), c.detach(), 3, 1e-3)


def test_channels_last_params_are_updated_in_their_own_layout():
    shape = (2, 3, 4, 5)
    ours = [
        p.detach().to(memory_format=torch.channels_last).requires_grad_()
        for p in make_params([shape], 7)
    ]
    theirs = make_params([shape], 7)
    grads = grad_stream([shape], 5, seed=7)
    opt = CPUAdamW(ours)
    run_(opt, ours, grads)  # contiguous grads on channels_last params: re-laid out per step
    run_(torch.optim.AdamW(theirs, fused=True), theirs, grads)
    assert opt.state[ours[0]]["exp_avg"].stride() == ours[0].stride()
    assert_within_rounding(ours[0].detach(), theirs[0].detach(), 5, 1e-3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"maximize": True}, "maximize"),
        ({"amsgrad": True}, "amsgrad"),
        ({"impl": "fast"}, "impl"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_unsupported_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPUAdamW(make_params([(3,)], 0), **kwargs)


def test_unsupported_param_dtype_is_rejected_clearly():
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = CPUAdamW([p])
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="float64"):
        opt.step()


def state_dict_round_trip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bit_identical(impl, dtype):
    shapes, total, k = [(23,), (4, 9)], 12, 5
    grads = grad_stream(shapes, total, seed=8, dtype=dtype)
    straight = make_params(shapes, 8, dtype)
    run_(CPUAdamW(straight, lr=1e-2, impl=impl), straight, grads)

    first = make_params(shapes, 8, dtype)
    opt = CPUAdamW(first, lr=1e-2, impl=impl)
    run_(opt, first, grads[:k])
    saved_params = state_dict_round_trip([p.detach() for p in first])
    saved_opt = state_dict_round_trip(opt.state_dict())

    resumed = [p.clone().requires_grad_() for p in saved_params]
    opt2 = CPUAdamW(resumed, lr=1e-2, impl=impl)
    opt2.load_state_dict(saved_opt)
    for p in resumed:
        assert opt2.state[p]["exp_avg"].dtype == torch.float32  # not cast to the param's dtype
    run_(opt2, resumed, grads[k:])
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_fp32_checkpoint_loads_into_bf16_params_with_master_from_param():
    shapes = [(10,), (2, 3)]
    fp32 = make_params(shapes, 9)
    opt = CPUAdamW(fp32)
    run_(opt, fp32, grad_stream(shapes, 3, seed=9))
    sd = state_dict_round_trip(opt.state_dict())
    assert all("master" not in s for s in sd["state"].values())

    low = [p.detach().to(torch.bfloat16).requires_grad_() for p in fp32]
    opt2 = CPUAdamW(low)
    opt2.load_state_dict(sd)
    for p, q in zip(low, fp32, strict=True):
        st2 = opt2.state[p]
        assert torch.equal(st2["master"], p.detach().float())
        assert torch.equal(st2["exp_avg"], opt.state[q]["exp_avg"])
    run_(opt2, low, grad_stream(shapes, 1, seed=10, dtype=torch.bfloat16))
    assert opt2.state[low[0]]["step"].item() == 4.0


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(
        dtype
    )


def train_(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for k in steps:
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(8, 6, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_state_dict_round_trip_resumes_bit_identically(dtype):
    straight = make_model(dtype)
    train_(straight, CPUAdamW(straight.parameters(), lr=1e-2), range(8))

    model = make_model(dtype)
    opt = CPUAdamW(model.parameters(), lr=1e-2)
    train_(model, opt, range(3))
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert set(osd["state"]["0.weight"]) == (
        {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if dtype == torch.bfloat16 else set())
    )

    model2 = make_model(dtype)
    model2.load_state_dict(model.state_dict())
    opt2 = CPUAdamW(model2.parameters(), lr=1e-2)
    set_optimizer_state_dict(model2, opt2, osd)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt2.state[model2[0].weight][key], osd["state"]["0.weight"][key])
    train_(model2, opt2, range(3, 8))
    for a, b in zip(straight.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_params_with_gaps_in_memory_are_rejected_clearly():
    base = torch.zeros(4, 6)
    p = base[:, :3].requires_grad_()
    opt = CPUAdamW([p])
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="dense"):
        opt.step()


def test_deepcopied_optimizer_keeps_its_impl():
    params = make_params([(5,)], 12)
    opt = copy.deepcopy(CPUAdamW(params, impl="reference"))
    assert opt.impl == "reference"


def test_torch_adamw_checkpoint_continues_in_cpu_adamw():
    shapes, total, k = [(19,), (3, 8)], 10, 4
    grads = grad_stream(shapes, total, seed=13)
    theirs = make_params(shapes, 13)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    run_(ref, theirs, grads[:k])
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    opt = CPUAdamW(ours, lr=1e-2)
    opt.load_state_dict(state_dict_round_trip(ref.state_dict()))
    run_(ref, theirs, grads[k:])
    run_(opt, ours, grads[k:])
    for a, b in zip(ours, theirs, strict=True):
        assert_within_rounding(a.detach(), b.detach(), total - k, 1e-2)
