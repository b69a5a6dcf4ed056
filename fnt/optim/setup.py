"""Building the optimizer and the offload plan from config.
`offload_plan` is pure. Side effects: `setup_optimizer` creates optimizer state for the model (and
builds the native kernel for ``optim.impl = "native"``); `apply_compute_dtype_` casts parameters
and hooks the model's and optimizer's state dicts; `set_lr_` sets the learning rate and
`set_hyperparameters_` all of the config's hyperparameters.

This module is the one place that reads the implementation and offload settings; the model loader
and the state builder act on the `OffloadPlan` it returns.

Offload modes (``optim.offload``; ``optim.impl`` must be "native" or "reference", the CPU AdamW):

- ``none``: the optimizer state lives with the parameters. The CPU AdamW needs CPU parameters,
  so on CUDA it is a config error that points to "state" or "full".
- ``state``: optimizer state on the CPU. Under FSDP2 (torchrun), ``CPUOffloadPolicy`` keeps the
  sharded parameters, their gradients and the state in (pinned, on CUDA) host memory; the CPU
  AdamW updates them there and FSDP2 copies parameters to the accelerator for compute. In a
  single CPU process everything already is on the CPU, so it equals ``none``.
- ``full``: ``state`` plus compute parameters in ``optim.offload_dtype``. Under FSDP2 the float32
  sharded CPU parameters are the master weights, and ``MixedPrecisionPolicy(param_dtype,
  reduce_dtype=float32)`` casts them for compute. In a single CPU process the model's parameters
  are cast to ``offload_dtype`` and the CPU AdamW keeps float32 masters. Parameters whose names
  contain a ``optim.keep_fp32`` substring (e.g. MoE routers, "mlp.gate") stay float32: under
  FSDP2 their modules are FSDP units of their own with a float32 policy, sharded before their
  decoder layer.
A single process on CUDA cannot offload (there is no FSDP2 to move parameters): launch it with
torchrun, one rank is fine. On CUDA with offload each rank is bound to its GPU's NUMA node.

Checkpoints and switching modes. Every checkpoint holds float32 weights and float32 moments, in
the same keys, whatever the offload mode it was written with:

- Under FSDP2 the sharded parameters are float32 in every mode, so this holds by construction.
- In a single process with ``full``, `apply_compute_dtype_` makes the model's state dict report
  the float32 masters instead of the low-precision parameters, and drops ``master`` from the
  optimizer's, so the master, the source of truth, is what is saved.
- Loading after the cast goes the other way (hooks of `apply_compute_dtype_`): the checkpoint's
  float32 weights are copied into the masters, the parameters get them rounded, and the
  optimizer's loaded state keeps those masters.
So a run saved with offload resumes without it and the other way round, bit for bit in the
weights: full -> none restores the float32 weights from the masters; none -> full primes the
masters from the float32 weights. Independently of DCP, `CPUAdamW.load_state_dict` copies a
saved ``master`` into a float32 parameter, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from fnt.config import ConfigError, ModelConfig, OptimConfig
from fnt.config.parallel import ParallelDims
from fnt.optim.adamw import CPUAdamW


@dataclass(frozen=True)
class OffloadPlan:
    """What the model loader and the state builder do for the offload settings."""

    offload_policy: Any = None
    """FSDP2 ``CPUOffloadPolicy`` for every unit, or None."""
    mp_policy: Any = None
    """FSDP2 ``MixedPrecisionPolicy`` for every unit but the keep_fp32 ones, or None."""
    compute_dtype: Optional[torch.dtype] = None
    """Dtype of the compute parameters under full offload; None keeps the model's dtype."""
    cast_params: bool = False
    """A single process casts the model's parameters to compute_dtype (full offload, no FSDP2)."""
    autocast: bool = False
    """A single process computes in compute_dtype under autocast over float32 parameters."""
    keep_fp32: tuple[str, ...] = ()
    """Parameter name substrings that stay float32 when compute_dtype is lower."""
    bind_numa: bool = False
    """Bind each rank to its GPU's NUMA node (CUDA with offload)."""


NO_OFFLOAD = OffloadPlan()


def offload_plan(
    optim_config: OptimConfig,
    device: torch.device,
    distributed: bool,
    compute_dtype: str = "float32",
) -> OffloadPlan:
    """The plan for ``optim.offload``, ``optim.impl`` and ``model.compute_dtype`` on ``device``;
    raises ConfigError for combinations that cannot work. Pure.

    Lower-precision compute over float32 parameters (the masters) is FSDP2's
    ``MixedPrecisionPolicy`` under torchrun; in one process it is the CPU AdamW's cast with
    masters under full offload, and autocast otherwise.
    """
    mode, impl = optim_config.offload, optim_config.impl
    cuda = device.type == "cuda"
    if mode != "none" and impl == "torch":
        raise ConfigError(
            f"'optim.offload' = {mode!r} needs the CPU AdamW, but 'optim.impl' = \"torch\": "
            'set optim.impl to "native" (or "reference"), or optim.offload to "none"'
        )
    if mode == "none" and impl != "torch" and cuda:
        raise ConfigError(
            f"'optim.impl' = {impl!r} updates parameters on the CPU, but with "
            '\'optim.offload\' = "none" they are on cuda: set optim.offload to "state" or '
            '"full" (under torchrun), or optim.impl to "torch"'
        )
    if mode != "none" and cuda and not distributed:
        raise ConfigError(
            f"'optim.offload' = {mode!r} on cuda needs FSDP2 to move parameters between host "
            "and device: launch with torchrun (--nproc-per-node 1 is fine)"
        )
    compute = _compute_dtype(optim_config, compute_dtype)
    keep = optim_config.keep_fp32
    if not distributed:
        # One process, no FSDP2: full offload casts the parameters (the CPU AdamW keeps float32
        # masters); other lower-precision compute runs under autocast over float32 parameters.
        if mode == "full":
            cast = compute not in (None, torch.float32)
            return OffloadPlan(compute_dtype=compute, cast_params=cast, keep_fp32=keep)
        if compute is None:
            return NO_OFFLOAD
        return OffloadPlan(compute_dtype=compute, autocast=True, keep_fp32=keep)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    return OffloadPlan(
        offload_policy=None if mode == "none" else CPUOffloadPolicy(pin_memory=cuda),
        mp_policy=(
            None
            if compute is None
            else MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        ),
        compute_dtype=compute,
        keep_fp32=keep,
        bind_numa=cuda and mode != "none",
    )


def _compute_dtype(optim_config: OptimConfig, compute_dtype: str) -> Optional[torch.dtype]:
    """The lower compute dtype asked for, or None for float32 compute."""
    if optim_config.offload == "full":
        if compute_dtype != "float32" and compute_dtype != optim_config.offload_dtype:
            raise ConfigError(
                f"'model.compute_dtype' = {compute_dtype!r} but full offload computes in "
                f"'optim.offload_dtype' = {optim_config.offload_dtype!r}: set them equal"
            )
        return getattr(torch, optim_config.offload_dtype)
    return None if compute_dtype == "float32" else getattr(torch, compute_dtype)


def fp32_module_names(param_names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """Modules that stay float32: the owners of the parameters whose names contain a keep_fp32
    substring, in parameter order ("" is the root). Pure."""
    matches = (name for name in param_names if any(pattern in name for pattern in patterns))
    return list(dict.fromkeys(name.rpartition(".")[0] for name in matches))


def setup_optimizer(
    optim_config: OptimConfig,
    model: nn.Module,
    parallel_dims: Optional[ParallelDims] = None,
    model_config: Optional[ModelConfig] = None,
) -> torch.optim.Optimizer:
    """AdamW (torch's or the CPU one) or SGD over the model's trainable parameters, and, called
    as the seed calls it (`setup_optimizer(config.optim, model, parallel_dims, config.model)`),
    the part of the offload plan that needs the optimizer: in one process, full offload's cast
    of the parameters to optim.offload_dtype over float32 masters in the CPU AdamW
    (`apply_compute_dtype_`, planned by `offload_plan` from the settings).

    The rest of the plan cannot wait for the optimizer, so `setup_trainer` decides it
    (Runtime.offload) and the model loader applies it: FSDP2's offload and mixed-precision
    policies are fixed when the model is sharded, and a rank's NUMA binding must precede its
    threads. `parallel_dims` is the seed's argument; the plan asks only whether the model runs
    under FSDP2, which a process group tells (torchrun with one process too).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if optim_config.name == "sgd":
        if optim_config.impl != "torch":
            raise ConfigError(
                f"'optim.impl' = {optim_config.impl!r} applies to adamw only; "
                'use "torch" with sgd'
            )
        return torch.optim.SGD(
            params,
            lr=optim_config.lr,
            momentum=optim_config.momentum,
            weight_decay=optim_config.weight_decay,
        )
    hyper = dict(
        lr=optim_config.lr,
        betas=optim_config.betas,
        eps=optim_config.eps,
        weight_decay=optim_config.weight_decay,
    )
    if optim_config.impl == "torch":
        # Fused: one kernel for all parameters, and a skipped update decided on the device
        # (fnt.update.skips_on_device); torch's default reads each step count back.
        return torch.optim.AdamW(params, fused=True, **hyper)
    devices = sorted({p.device.type for p in params} - {"cpu"})
    if devices:
        raise ConfigError(
            f"'optim.impl' = {optim_config.impl!r} updates parameters on the CPU, but some are "
            f'on {", ".join(devices)}: set optim.offload to "state" or "full" (under torchrun)'
        )
    optimizer = CPUAdamW(params, impl=optim_config.impl, **hyper)
    if model_config is not None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        plan = offload_plan(optim_config, params[0].device, distributed, model_config.compute_dtype)
        apply_compute_dtype_(model, optimizer, plan)
    return optimizer


def apply_compute_dtype_(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: OffloadPlan
) -> None:
    """Single-process full offload: cast float32 parameters to the compute dtype, after priming
    the CPU AdamW's masters with their float32 values.

    Modules owning a keep_fp32 parameter stay float32 and cast floating inputs to float32, as
    their FSDP2 units do under torchrun. From here on the model's state dict reports the masters
    as its weights and the optimizer's omits ``master``, so checkpoints hold float32 weights
    (see the module docstring); loading a state dict does the reverse: the float32 weights become
    the masters (the parameters get them rounded) and the optimizer keeps those masters. No-op
    unless ``plan.cast_params``.
    """
    if not plan.cast_params:
        return
    fp32_modules = fp32_module_names([n for n, _ in model.named_parameters()], plan.keep_fp32)
    masters: dict[nn.Parameter, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or name.rpartition(".")[0] in fp32_modules:
            continue
        if not p.requires_grad:  # a frozen base weight (LoRA) is only computed with
            p.data = p.data.to(plan.compute_dtype)
            continue
        master = p.detach().clone()
        # Rounds to nearest even, as the CPU AdamW rounds a master into its param after a step.
        p.data = p.data.to(plan.compute_dtype)
        optimizer.state[p]["master"] = master
        masters[p] = master
    optimizer.init_state_()
    for module_name in fp32_modules:
        model.get_submodule(module_name).register_forward_pre_hook(float32_inputs)

    saved_names = {
        name: masters[p]
        for name, p in model.named_parameters(remove_duplicate=False)
        if p in masters
    }

    def report_masters(module, state_dict, prefix, local_metadata):
        for name, master in saved_names.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = master

    index = {
        p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }
    cast_ids = {index[p] for p in masters if p in index}

    def drop_masters(opt, state_dict):
        # The packed entries are the live state dicts: replace them, never mutate them.
        state_dict["state"] = {
            i: {k: v for k, v in st.items() if not (i in cast_ids and k == "master")}
            for i, st in state_dict["state"].items()
        }
        return state_dict

    def load_masters(module, state_dict, prefix, *args):
        # The loaded float32 weights are the truth; the parameters' own load rounds them.
        for name, master in saved_names.items():
            if prefix + name in state_dict:
                master.copy_(state_dict[prefix + name])

    params_in_order = [p for group in optimizer.param_groups for p in group["params"]]

    def keep_masters(opt, state_dict):
        # Without this the CPU AdamW would prime fresh masters from the rounded parameters. The
        # saved ids (ints, or names from torch's state-dict helpers) list params in group order.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        by_id = {i: masters[p] for i, p in zip(saved_ids, params_in_order) if p in masters}
        state_dict["state"] = {
            i: {**st, "master": by_id[i]} if i in by_id else st
            for i, st in state_dict["state"].items()
        }
        return state_dict

    model.register_state_dict_post_hook(report_masters)
    model.register_load_state_dict_pre_hook(load_masters)
    optimizer.register_state_dict_post_hook(drop_masters)
    optimizer.register_load_state_dict_pre_hook(keep_masters)


def float32_inputs(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: floating-point positional inputs cast to float32."""
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def set_lr_(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def set_hyperparameters_(optimizer: torch.optim.Optimizer, optim_config: OptimConfig) -> None:
    """Set the config's hyperparameters on every parameter group, as `setup_optimizer` does.

    Loading an optimizer's state dict restores the hyperparameters it was saved with; a resumed
    run calls this afterwards so that the current config's values are the ones used.
    """
    if optim_config.name == "sgd":
        hyper = dict(momentum=optim_config.momentum, weight_decay=optim_config.weight_decay)
    else:
        hyper = dict(
            betas=tuple(optim_config.betas),
            eps=optim_config.eps,
            weight_decay=optim_config.weight_decay,
        )
    for group in optimizer.param_groups:
        group.update(lr=optim_config.lr, **hyper)
