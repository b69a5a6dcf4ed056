"""LoRA adapters on a Hugging Face causal LM, built with PEFT (model.lora).
Side effects: `add_adapters_` replaces the target modules in place (PEFT's LoRA layers) and
freezes everything else; `init_adapters_` writes the adapters' starting values into their (maybe
sharded) parameters; `adapters_disabled` switches every adapter off inside its block, making the
model its base (RL's reference policy); `save_adapter_` writes a PEFT adapter directory.
`merge_adapters` (pure) returns a state dict with the adapters added into the base weights;
`base_fingerprint` reads and hashes a base directory's index.

Why PEFT's layers inside fnt's own loading: the adapter format is the one vLLM, TRL and
`PeftModel.from_pretrained` read, and PEFT's `inject_adapter_in_model` works on the model in
place, on the meta device too, so the sharded path (fnt.model.loading) stays as it is: build on
meta, add adapters, shard with FSDP2, allocate, read the base's shards, then `init_adapters_`. The
adapters start from a function of (seed, parameter name) rather than PEFT's draws from the global
RNG, so one rank and two ranks start alike and a meta-built model gets the same values as a loaded
one.

Parameter names: an adapted linear `q_proj` holds the base weight as `q_proj.base_layer.weight`
and its adapter as `q_proj.lora_A.default.weight` [r, in] and `q_proj.lora_B.default.weight`
[out, r]; a module in modules_to_save keeps the base as `original_module.*` and trains a copy,
`modules_to_save.default.*`. `base_name` maps either back to the name in the base's files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import Tensor, nn

from fnt.config import ConfigError, LoraConfig
from fnt.model.shards import shard_rows

ADAPTER = "default"  # PEFT's adapter name: fnt trains one adapter per model
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# What PEFT's saved adapter keys start with (PeftModel -> LoraModel -> the model).
PEFT_PREFIX = "base_model.model."
_WRAPPER_PARTS = (".base_layer.", ".original_module.", f".modules_to_save.{ADAPTER}.")


def peft_lora_config(lora: LoraConfig):
    """PEFT's LoraConfig for model.lora."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets),
        modules_to_save=list(lora.modules_to_save) or None,
    )


def is_adapted(model: nn.Module) -> bool:
    """Does `model` carry LoRA adapters (add_adapters_ ran on it)?"""
    return hasattr(model, "peft_config")


def lora_of(model: nn.Module) -> LoraConfig:
    """The model.lora an adapted model was built with (its target modules as PEFT resolved
    them: module names that select the same modules again)."""
    peft = model.peft_config[ADAPTER]
    targets = peft.target_modules
    return LoraConfig(
        rank=peft.r,
        alpha=float(peft.lora_alpha),
        dropout=float(peft.lora_dropout),
        target_modules=(targets,) if isinstance(targets, str) else tuple(sorted(targets)),
        modules_to_save=tuple(sorted(peft.modules_to_save or ())),
    )


def add_adapters_(model: nn.Module, lora: LoraConfig) -> None:
    """Put PEFT's LoRA layers on model.lora.target_modules and copies of modules_to_save, in
    place; every other parameter is frozen (requires_grad False). The adapters are float32 (a
    bfloat16 base stays bfloat16: PEFT casts each adapter's input and output); the copies of
    modules_to_save keep the model's dtype. On a meta-device model the adapters are on the meta
    device too (their values come from `init_adapters_`)."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_lora_config(lora), model, adapter_name=ADAPTER)
    except ValueError as exc:  # PEFT's "Target modules {...} not found in the base model"
        raise ConfigError(
            f"'model.lora.target_modules' = {list(lora.target_modules)!r}: {exc}"
        ) from None
    for name, param in model.named_parameters():
        if is_adapter_weight(name):  # trained in float32, whatever the base's dtype
            param.data = param.data.float()
    missing = [name for name in lora.modules_to_save if not _has_module_named(model, name)]
    if missing:
        raise ConfigError(
            f"'model.lora.modules_to_save' = {list(lora.modules_to_save)!r}: the model has no "
            f"module named {missing[0]!r}"
        )


def _has_module_named(model: nn.Module, name: str) -> bool:
    return any(n == name or n.endswith("." + name) for n, _ in model.named_modules())


def base_name(name: str) -> str:
    """The base model's name for a parameter of the adapted model (itself if not wrapped)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, ".")
    return name


def is_adapter_weight(name: str) -> bool:
    """A LoRA factor (lora_A/lora_B, or lora_embedding_A/B): not in the base's files."""
    return ".lora_" in name


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """The starting value of the adapter factor `name` (float32, on the CPU). Pure.

    The update B @ A starts at zero, as in PEFT: lora_A uniform in +-1/sqrt(fan_in) (PEFT's
    kaiming_uniform with a = sqrt(5)) and lora_B zero; for an embedding, A zero and B standard
    normal. The draws come from a generator seeded by (seed, name).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    kind = name.split(".lora_", 1)[1].split(".", 1)[0]
    if kind == "A":
        bound = 1.0 / math.sqrt(shape[1])
        return torch.rand(shape, generator=generator).mul_(2 * bound).sub_(bound)
    if kind == "embedding_B":
        return torch.randn(shape, generator=generator)
    if kind in ("B", "embedding_A"):
        return torch.zeros(shape)
    raise ValueError(f"{name}: fnt initializes LoRA factors A and B only, not lora_{kind}")


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int) -> None:
    """Write `adapter_init` into every adapter factor of `model`: under FSDP2 each rank its own
    rows of it. The modules_to_save copies hold the base's values already (read from its files
    like the base's own)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not is_adapter_weight(name):
            continue
        start, stop = shard_rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        full = adapter_init(name, tuple(param.shape), seed)
        local[: stop - start].copy_(full[start:stop])


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block the model computes as its base: every adapter is off and each
    modules_to_save wrapper uses the original module. A no-op for a model without adapters.

    PEFT's own switch (`enable_adapters(False)`) also clears requires_grad on the adapters,
    which would take them out of FSDP2's gradient reduction; this sets the flag PEFT's forwards
    read and leaves requires_grad alone (the block is meant for no-grad forwards)."""
    if not is_adapted(model):
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    switches = [
        module
        for module in model.modules()
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))
    ]
    for module in switches:
        module._disable_adapters = True
    try:
        yield
    finally:
        for module in switches:
            module._disable_adapters = False


def merge_adapters(state_dict: Mapping[str, Tensor], lora: LoraConfig) -> dict[str, Tensor]:
    """The base model's state dict with the adapters merged in, from the adapted model's full
    state dict: W + (alpha / rank) * B @ A for each adapted linear ((B @ A)^T for an embedding),
    the trained copy for each module in modules_to_save; names as in the base's files. Pure:
    each merged weight is a new tensor, because a one-process model's state dict holds its live
    parameters (merging those in place would add the adapters into the model being trained)."""
    scale = lora.alpha / lora.rank
    merged: dict[str, Tensor] = {}
    for name, value in state_dict.items():
        if is_adapter_weight(name) or ".original_module." in name:
            continue
        if name.endswith(".base_layer.weight"):
            delta = _delta(state_dict, name[: -len("base_layer.weight")])
            value = value + delta.mul_(scale).to(device=value.device, dtype=value.dtype)
        merged[base_name(name)] = value
    return merged


def _delta(state_dict: Mapping[str, Tensor], prefix: str) -> Tensor:
    """B @ A of the adapter of the module at `prefix` (a linear's, or an embedding's transposed)."""
    linear = f"{prefix}lora_A.{ADAPTER}.weight"
    if linear in state_dict:
        return state_dict[f"{prefix}lora_B.{ADAPTER}.weight"].float() @ state_dict[linear].float()
    a = state_dict[f"{prefix}lora_embedding_A.{ADAPTER}"].float()
    return (state_dict[f"{prefix}lora_embedding_B.{ADAPTER}"].float() @ a).T


def save_adapter_(
    out_dir: Path, model: nn.Module, state_dict: Mapping[str, Tensor], base_dir: str
) -> Path:
    """Write `state_dict`'s adapters as a PEFT adapter directory: adapter_config.json (naming
    `base_dir` as the base) and adapter_model.safetensors, what `PeftModel.from_pretrained` and
    vLLM's --lora-modules load. `model` is the adapted model the state dict is of."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=dict(state_dict), adapter_name=ADAPTER)
    tensors = {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in adapter.items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.peft_config[ADAPTER].to_dict()
    config.update(base_model_name_or_path=os.path.abspath(base_dir), inference_mode=True)
    for key, value in config.items():  # sets (target_modules) are not JSON
        if isinstance(value, set):
            config[key] = sorted(value)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def base_fingerprint(model_dir: str | Path) -> str:
    """A hash of a base model directory's config.json and its weights' index: the header of each
    safetensors file (every tensor's name, dtype, shape and offsets) and the file's size. Reads a
    few kilobytes, however large the model; a different base, or the same one re-saved with other
    tensors, gets another fingerprint."""
    import xxhash

    root = Path(model_dir)
    digest = xxhash.xxh3_128()
    digest.update((root / "config.json").read_bytes())
    for file in sorted(root.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            digest.update(file.name.encode() + b"\0" + handle.read(length))
        digest.update(str(file.stat().st_size).encode())
    return digest.hexdigest()
