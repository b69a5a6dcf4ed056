"""CPU AdamW for optimizer state held in host memory, with fp32 master weights.
Side effects: ``CPUAdamW.step`` updates parameters and optimizer state in place;
``CPUAdamW(impl="native")`` compiles the C++ kernel on first use in a process (see
``fnt.native.build``). ``adamw_reference_`` updates the tensors it is given in place.

The update is decoupled-weight-decay AdamW with bias correction, computed in float32 with the
operation order of ``torch.optim.AdamW(fused=True)``:

    w  = w * (1 - lr * wd)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    w  = w + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Per-param state (torch's keys, so torch.optim.AdamW checkpoints load into it and back):
``step`` (float32 scalar tensor), ``exp_avg`` and ``exp_avg_sq`` (float32, shaped like the param),
and for bfloat16/float16 params ``master``, the float32 weights. A low-precision param is written
from its master in the same pass (round to nearest even), so the master is the source of truth:
change the param and the next step overwrites it from the master. For the same reason
``CPUAdamW.load_state_dict`` copies a saved ``master`` into a float32 param (side effect).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from fnt.native import build as _native

IMPLS = ("native", "reference")
_TORCH_LANES = 8  # see adamw_reference_
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_SUPPORTED = (torch.float32, *_LOW_PRECISION)


def adamw_reference_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in plain torch ops: the oracle for the native kernel, same arguments.

    Increments each ``steps`` counter. Where ``masters[i]`` is a tensor the update runs on it and
    ``params[i]`` receives the rounded result; otherwise ``params[i]`` (float32) is updated.
    Rounding matches the kernel step for step (see fnt/native/adamw.cpp), including the last
    ``numel % 8`` elements in memory order, where torch's fused kernel, and so ours, forms a
    different fma for ``exp_avg_sq``.
    """
    decay = 1.0 - lr * weight_decay
    for p, g, m, v, master, step in zip(
        params, grads, exp_avgs, exp_avg_sqs, masters, steps, strict=True
    ):
        step.add_(1.0)
        t = step.item()
        neg_step_size = -(lr / (1.0 - beta1**t))
        bias_corr2_sqrt = math.sqrt(1.0 - beta2**t)
        weights = p if master is None else master
        g32 = torch.empty_like(weights).copy_(g)  # float32, laid out like the param
        w_, g_, m_, v_ = (_memory_order(x) for x in (weights, g32, m, v))
        body = w_.numel() - w_.numel() % _TORCH_LANES

        w_.mul_(decay)
        m_.lerp_(g_, 1.0 - beta1)
        # addcmul computes input + value * t1 * t2 as fma(value * t1, t2, input).
        tail_gg = g_[body:].mul(1.0 - beta2).mul_(g_[body:])
        v_[body:] = torch.addcmul(tail_gg, v_[body:], _full_like(v_[body:], beta2))
        v_[:body].mul_(beta2).addcmul_(g_[:body], g_[:body], value=1.0 - beta2)
        # A double sqrt rounded to float is exact, torch's float32 sqrt is not always; torch
        # turns division by a scalar into multiplication by its reciprocal, and division by an
        # expanded tensor into true division, as in the kernel.
        denom = v_.double().sqrt_().to(torch.float32)
        denom.div_(_full_like(denom, bias_corr2_sqrt)).add_(eps)
        w_.add_(m_.mul(neg_step_size).div_(denom))
        if master is not None:
            p.copy_(master)


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order, as the kernel walks them."""
    return t.as_strided((t.numel(),), (1,))


def _full_like(t: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` broadcast to ``t``'s shape without allocating."""
    return torch.tensor(value, dtype=t.dtype).expand_as(t)


class CPUAdamW(torch.optim.Optimizer):
    """AdamW over CPU tensors (or CPU DTensors), fp32 master weights for bf16/fp16 params.

    ``impl="native"`` runs one multithreaded C++ pass per param group over all its tensors;
    ``impl="reference"`` runs ``adamw_reference_`` (same math, same state). Gradients are only
    read. ``maximize`` and ``amsgrad`` are not supported and are rejected when true.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        impl: str = "native",
        *,
        maximize: bool = False,
        amsgrad: bool = False,
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"CPUAdamW: impl must be one of {IMPLS}, got {impl!r}")
        _reject_unsupported(maximize=maximize, amsgrad=amsgrad)
        _check_hyper(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.impl = impl
        if impl == "native":
            _native.load()  # build (or fetch from the cache) now: a missing compiler fails here

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "impl": self.impl}

    def init_state_(self) -> None:
        """Give every param its full state now (zero moments, step 0), as its first step would.

        A checkpoint load fills only the state entries that exist, and torch's state-dict helpers
        initialise an optimizer's state only when it is entirely empty; a state holding just the
        primed masters (fnt.optim.setup.apply_compute_dtype_) needs this instead.
        """
        for group in self.param_groups:
            for p in group["params"]:
                if "exp_avg" not in self.state[p]:
                    _init_state_(p, self.state[p])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every param that has a grad; ``closure`` recomputes the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _reject_unsupported(
                maximize=group.get("maximize", False), amsgrad=group.get("amsgrad", False)
            )
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            _check_hyper(lr, (beta1, beta2), group["eps"], group["weight_decay"])
            lists = self._gather_(group)
            if lists[0]:
                kernel = _native.load().adamw_step_ if self.impl == "native" else adamw_reference_
                kernel(
                    *lists,
                    lr=lr,
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                )
        return loss

    def _gather_(self, group: dict[str, Any]) -> tuple[list, ...]:
        """Local tensors of the params of ``group`` that have grads; initialises missing state."""
        params, grads, exp_avgs, exp_avg_sqs, masters, steps = [], [], [], [], [], []
        state = self.state
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            st = state[p]
            if "exp_avg" not in st:  # fresh, or holding only a primed master
                _init_state_(p, st)
            m, v, master = st["exp_avg"], st["exp_avg_sq"], st.get("master")
            # The kernel works on this rank's shard; under no_grad to_local() is an attribute
            # read, and the state DTensors share the param's sharding.
            params.append(_local(p))
            grads.append(_local(g))
            exp_avgs.append(_local(m))
            exp_avg_sqs.append(_local(v))
            masters.append(None if master is None else _local(master))
            steps.append(st["step"])
        return params, grads, exp_avgs, exp_avg_sqs, masters, steps

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except the state policy: moments and master stay float32 for every
        param dtype (torch would cast them to a bf16 param's dtype), a bf16/fp16 param whose
        state lacks ``master`` (e.g. from a float32 run) gets one from its current value, and a
        float32 param whose state has a ``master`` (from a bf16 run) is overwritten with it.

        Like torch, tensors already of the right dtype, device and layout are used, not copied.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group "
                    "that doesn't match the size of optimizer's group"
                )
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key in id_map:
                state[id_map[key]] = _loaded_state(id_map[key], value)
            else:
                state[key] = value  # kept as torch keeps it: state of no current param
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            saved["params"] = group["params"]
            if "param_names" in group and "param_names" not in saved:
                saved["param_names"] = group["param_names"]
        self.__setstate__({"state": state, "param_groups": saved_groups})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _reject_unsupported(*, maximize: bool, amsgrad: bool) -> None:
    if maximize:
        raise ValueError("CPUAdamW does not support maximize=True")
    if amsgrad:
        raise ValueError("CPUAdamW does not support amsgrad=True")


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"CPUAdamW: invalid lr {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"CPUAdamW: invalid betas {betas}, each must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"CPUAdamW: invalid eps {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"CPUAdamW: invalid weight_decay {weight_decay}")


def _check_param(p: torch.Tensor) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdamW: params must be on CPU, got one on {p.device}")
    if p.dtype not in _SUPPORTED:
        raise ValueError(f"CPUAdamW: param dtype must be one of {_SUPPORTED}, got {p.dtype}")
    local = _local(p)
    if not _is_dense(local):
        raise ValueError(
            "CPUAdamW: params must be dense in memory (a view with gaps, such as a slice of a "
            f"larger tensor, cannot be updated in one pass); got strides {local.stride()} for "
            f"shape {tuple(local.shape)}"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a contiguous memory range in some dimension order."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if size == 0:
            return True
        if stride != expected:
            return False
        expected *= size
    return True


def _init_state_(p: torch.Tensor, st: dict[str, Any]) -> None:
    """Fresh state for ``p``; zeros_like keeps DTensor-ness and layout, so DCP sees the param's
    sharding on every state tensor. A ``master`` already in ``st`` is kept: it was primed from
    float32 weights before ``p`` was cast down (fnt.optim.setup.apply_compute_dtype_)."""
    _check_param(p)
    st["step"] = torch.tensor(0.0, dtype=torch.float32)
    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
    if p.dtype in _LOW_PRECISION and "master" not in st:
        st["master"] = p.detach().to(torch.float32, copy=True)


def _as_fp32_like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as float32 on ``p``'s device with ``p``'s strides (the kernel needs both)."""
    t = value.to(device=p.device, dtype=torch.float32)
    if t.shape != p.shape:
        raise ValueError(
            f"CPUAdamW: loaded state of shape {tuple(t.shape)} for a param of shape "
            f"{tuple(p.shape)}"
        )
    if isinstance(t, DTensor) != isinstance(p, DTensor):
        raise ValueError("CPUAdamW: loaded state must be a DTensor exactly when its param is")
    if t.stride() != p.stride():
        t = torch.empty_like(p, dtype=torch.float32).copy_(t)
    return t


def _loaded_state(p: torch.Tensor, saved: dict[str, Any]) -> dict[str, Any]:
    """State for ``p`` from a saved entry, with this optimizer's dtype policy."""
    _check_param(p)
    st = dict(saved)
    st["step"] = torch.as_tensor(saved["step"], dtype=torch.float32, device="cpu")
    for key in ("exp_avg", "exp_avg_sq"):
        st[key] = _as_fp32_like(p, saved[key])
    if p.dtype in _LOW_PRECISION:
        master = saved.get("master")
        st["master"] = (
            p.detach().to(torch.float32, copy=True) if master is None else _as_fp32_like(p, master)
        )
    elif "master" in st:
        # A float32 param is its own master. A saved master (from a bf16 run) is the source of
        # truth of that run's weights, more precise than its rounded params: it becomes the param.
        p.detach().copy_(_as_fp32_like(p, st.pop("master")))
    return st
