"""Model loading and sharding. Side effects: reads the model directory, wraps modules in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fnt.config import ConfigError, ModelConfig
from fnt.model.attention import hf_attention_name, resolve_kernel
from fnt.model.compile import compile_layers_, compiles
from fnt.model.lm_head import resolve_loss_kernel, use_loss_kernel_
from fnt.model.lora import add_adapters_, init_adapters_
from fnt.model.sharded_load import load_shards_, params_on_meta
from fnt.optim.setup import NO_OFFLOAD, OffloadPlan, float32_inputs, fp32_module_names

if TYPE_CHECKING:
    from fnt.distributed.runtime import Runtime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the whole model (for FLOP counts)."""

    num_params: int
    num_layers: int
    hidden_size: int
    frozen_params: int = 0  # of num_params, those that do not train (a LoRA base)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers ModuleList to shard")
    return layers


def load_hf_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(model.name)` with the configured dtype and attention
    kernel, moved to `device`; the one place fnt loads a Hugging Face model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_config.name,
        dtype=DTYPES[model_config.dtype],
        attn_implementation=attention_for(model_config, device.type),
    )
    return model.to(device)


def model_facts(model: nn.Module) -> ModelFacts:
    """Sizes of the whole model, sharded or not (a DTensor counts its global elements)."""
    return ModelFacts(
        num_params=sum(p.numel() for p in model.parameters()),
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
    )


def attention_for(model_config: ModelConfig, device_type: str) -> str:
    """transformers' name of the kernel model.attn_implementation means on `device_type`
    (fnt.model.attention: "auto" resolved, fnt's own functions registered)."""
    dtype = compute_dtype_of(model_config)
    return hf_attention_name(resolve_kernel(model_config.attn_implementation, device_type, dtype))


def compute_dtype_of(model_config: ModelConfig) -> str:
    """The dtype the model computes in: model.compute_dtype when lower than its dtype."""
    if model_config.compute_dtype != "float32":
        return model_config.compute_dtype
    return model_config.dtype


def empty_hf_model(model_config: ModelConfig, device_type: str = "cpu") -> nn.Module:
    """The model's architecture with its parameters on the meta device (no memory) and its
    buffers computed; the weights come later (fnt.model.sharded_load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_config.name)
    with params_on_meta():
        return AutoModelForCausalLM.from_config(
            hf_config,
            dtype=DTYPES[model_config.dtype],
            attn_implementation=attention_for(model_config, device_type),
        )


def load_model(
    model_config: ModelConfig, runtime: Runtime, plan: OffloadPlan = NO_OFFLOAD, seed: int = 0
) -> nn.Module:
    """The model for training, with LoRA adapters, activation checkpointing, compiled decoder
    layers (model.compile, fnt.model.compile) and FSDP2 as configured.

    In one process it is `from_pretrained`. Under torchrun no rank loads the whole model: it is
    built on the meta device, sharded, allocated on the device, and each rank reads its shards
    from the safetensors files (fnt.model.sharded_load). ``plan`` (from
    fnt.optim.setup.offload_plan) gives the FSDP2 offload and mixed-precision policies
    (setup_trainer has already bound the process to its GPU's NUMA node when offloading). With
    model.lora.rank > 0 the base is frozen and the adapters (fnt.model.lora) start from a function
    of `seed`, on any number of ranks.
    """
    if runtime.distributed:
        model = empty_hf_model(model_config, runtime.device.type)
    else:
        model = load_hf_model(model_config, runtime.device)
    if model_config.lora.rank:
        add_adapters_(model, model_config.lora)
    if model_config.ac:
        # transformers 5 renamed gradient_checkpointing_enable; accept both generations.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.config.use_cache = False
    use_loss_kernel_(model, resolve_loss_kernel(model_config.loss_kernel, runtime.device.type))
    if plan.autocast:
        autocast_forward_(model, runtime.device, plan)
    # Before FSDP2 wraps the layers, so each shard unit is compiled.
    if compiles(model_config.compile, runtime.device.type, model_config.ac):
        compile_layers_(decoder_layers(model))
    if runtime.distributed:
        shard_model_(model, data_parallel_mesh(runtime), plan)
        allocate_sharded_(model, runtime.device, offloaded=plan.offload_policy is not None)
        load_shards_(model, model_config.name)
    if model_config.lora.rank:
        init_adapters_(model, seed)
    model.train()
    return model


def autocast_forward_(model: nn.Module, device: torch.device, plan: OffloadPlan) -> None:
    """Run the model's forward under autocast to plan.compute_dtype (one process, float32
    parameters); modules owning a keep_fp32 parameter run in float32, with float32 inputs."""
    model.forward = torch.autocast(device.type, dtype=plan.compute_dtype)(model.forward)
    for name in fp32_module_names([n for n, _ in model.named_parameters()], plan.keep_fp32):
        module = model.get_submodule(name)
        module.forward = torch.autocast(device.type, enabled=False)(module.forward)
        module.register_forward_pre_hook(float32_inputs)


def allocate_sharded_(model: nn.Module, device: torch.device, *, offloaded: bool) -> None:
    """Allocate a meta-built, sharded model's parameters (uninitialized) and put its buffers,
    whose values were computed at build time, on `device`. Under CPU offload the sharded
    parameters live in host memory; FSDP2 moves them to `device` for compute."""
    buffers = {
        (module, name): buffer
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
    }
    model.to_empty(device=torch.device("cpu") if offloaded else device)
    for (module, name), buffer in buffers.items():
        module._buffers[name] = buffer.to(device)


def data_parallel_mesh(runtime: Runtime) -> Any:
    """The mesh FSDP2 shards over: 1-D dp_shard, or 2-D (replicate, shard) for HSDP."""
    if runtime.dims.dp_replicate > 1:
        return runtime.mesh
    return runtime.mesh["dp_shard"]


def shard_model_(model: nn.Module, mesh: Any, plan: OffloadPlan = NO_OFFLOAD) -> None:
    """FSDP2: each decoder layer is its own unit, then the root takes embeddings and head.

    Under a mixed-precision plan, each module owning a keep_fp32 parameter becomes a unit of its
    own with a float32 policy, sharded before the unit that contains it (a unit's policy covers
    every parameter not already in a nested unit).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policies = {}
    if plan.offload_policy is not None:
        policies["offload_policy"] = plan.offload_policy
    fp32_units: list[nn.Module] = []
    if plan.mp_policy is not None:
        policies["mp_policy"] = plan.mp_policy
        names = fp32_module_names([n for n, _ in model.named_parameters()], plan.keep_fp32)
        if "" in names:
            raise ConfigError(f"'optim.keep_fp32' = {plan.keep_fp32}: matches a root parameter")
        fp32_units = [model.get_submodule(name) for name in names]
    fp32_policies = {
        **policies,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    }
    layers = decoder_layers(model)
    sharded: set[nn.Module] = set()
    for layer in layers:
        inside = {id(m) for m in layer.modules()}
        for unit in fp32_units:
            if id(unit) in inside and unit is not layer:
                fully_shard(unit, mesh=mesh, **fp32_policies)
                sharded.add(unit)
        fully_shard(layer, mesh=mesh, **(fp32_policies if layer in fp32_units else policies))
        sharded.add(layer)
    for unit in fp32_units:
        if unit not in sharded:
            fully_shard(unit, mesh=mesh, **fp32_policies)
    fully_shard(model, mesh=mesh, **policies)


def without_tied_duplicates(model: nn.Module, state_dict: dict) -> dict:
    """`state_dict` without the later names of a parameter the model shares (tied embeddings:
    `lm_head.weight` is `model.embed_tokens.weight`), for `save_pretrained(state_dict=...)`.

    save_pretrained drops such a name only when both entries are one tensor. A full state dict
    gathered from FSDP2 shards holds a copy per name, so without this a tied model's directory
    would hold its embedding twice (600 MB more for Qwen3-0.6B in float32). A tied model's files
    hold the first name only, which from_pretrained ties back."""
    first: dict[int, str] = {}
    later = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            later.add(name)
        else:
            first[id(param)] = name
    return {key: value for key, value in state_dict.items() if key not in later}
