"""Model loading and sharding. Side effects: reads the model directory, wraps modules in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fnt.config import ModelConfig
from fnt.setup import Runtime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the unsharded model, taken before sharding (for FLOP counts)."""

    num_params: int
    num_layers: int
    hidden_size: int


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers ModuleList to shard")
    return layers


def load_model(model_config: ModelConfig, runtime: Runtime) -> tuple[nn.Module, ModelFacts]:
    """from_pretrained a local directory, then activation checkpointing and FSDP2 as configured."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_config.name,
        dtype=DTYPES[model_config.dtype],
        attn_implementation=model_config.attn_implementation,
    )
    model.to(runtime.device)
    hf = model.config
    facts = ModelFacts(
        num_params=sum(p.numel() for p in model.parameters()),
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
    )
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
    if runtime.distributed:
        shard_model_(model, data_parallel_mesh(runtime))
    model.train()
    return model, facts


def data_parallel_mesh(runtime: Runtime) -> Any:
    """The mesh FSDP2 shards over: 1-D dp_shard, or 2-D (replicate, shard) for HSDP."""
    if runtime.dims.dp_replicate > 1:
        return runtime.mesh
    return runtime.mesh["dp_shard"]


def shard_model_(model: nn.Module, mesh: Any) -> None:
    """FSDP2: each decoder layer is its own unit, then the root takes embeddings and head."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
