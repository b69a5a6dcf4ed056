"""Building a model without its weights, and loading each rank's shards from safetensors files.
Side effects: `params_on_meta` patches parameter registration while it is active; the loader
reads the model directory and writes into the model's (sharded) parameters in place.

Under torchrun no rank ever holds the whole model: the model is built with its parameters on the
meta device (buffers, such as the rotary `inv_freq`, are computed for real: they are small and
not in the files), sharded with FSDP2, allocated (`to_empty`), and then every rank reads from
the safetensors files only the rows of each tensor that its shard holds (`safe_open().get_slice`).

FSDP2 shards every parameter on dim 0 over the data-parallel shard dimension of the mesh, in
`torch.chunk` pieces: with n rows over k ranks, rank r holds rows [r*c, min((r+1)*c, n)) for
c = ceil(n / k). Parameters whose checkpoint layout differs from the module's are built from the
files here too: the fused experts of transformers' MoE blocks (`mlp.experts.gate_up_proj`
[E, 2I, H] from each expert's gate_proj and up_proj, `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from fnt.errors import ConfigError
from fnt.model.lora import base_name, is_adapter_weight
from fnt.model.shards import shard_rows

_FUSED_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)")


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to the meta device (no memory);
    buffers stay where they are created, with their real values."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class SafetensorsDir:
    """The tensors of a Hugging Face model directory (one file, or several with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (root / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ConfigError(
                f"'model.name' = {str(model_dir)!r}: no model.safetensors (or its index) there; "
                "sharded loading reads safetensors files"
            )
        self.handles = [safe_open(root / name, framework="pt") for name in files]
        self.where = {key: h for h in self.handles for key in h.keys()}

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) on dim 0 of a stored tensor, read without the rest."""
        return self.where[key].get_slice(key)[start:stop]

    def __contains__(self, key: str) -> bool:
        return key in self.where


def stored_rows(files: SafetensorsDir, key: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the parameter `key` as the module holds it, read from the files."""
    if key in files:
        return files.rows(key, start, stop)
    fused = _FUSED_EXPERTS.fullmatch(key)
    if fused is not None:
        prefix = fused["prefix"]
        parts = ("gate_proj", "up_proj") if fused["kind"] == "gate_up_proj" else ("down_proj",)
        names = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(start, stop)]
        if all(name in files for expert in names for name in expert):
            experts = [
                torch.cat([files.rows(name, 0, None) for name in expert]) for expert in names
            ]
            return torch.stack(experts) if experts else torch.empty(0)
    raise ConfigError(f"the model directory holds no tensor for parameter {key!r}")


@torch.no_grad()
def load_shards_(model: nn.Module, model_dir: str | Path) -> None:
    """Copy each rank's rows of every parameter from the safetensors files into the model; a
    LoRA-adapted model's wrapped base weights under their base names (fnt.model.lora.base_name)."""
    from torch.distributed.tensor import DTensor

    files = SafetensorsDir(model_dir)
    for key, param in model.named_parameters():  # a tied weight is listed once
        if is_adapter_weight(key):  # not in the base's files: fnt.model.lora.init_adapters_
            continue
        start, stop = shard_rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        if stop > start:
            local[: stop - start].copy_(stored_rows(files, base_name(key), start, stop))
