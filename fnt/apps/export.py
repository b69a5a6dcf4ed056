"""Checkpoint -> Hugging Face directory. Side effects: reads a checkpoint, writes a directory.

The directory is written whole or not at all (fnt.store.transaction.staged_dir_), and only
where no one else's files are (fnt.apps.preflight.check_export): a new or empty directory, an
earlier export (its COMPLETE marker names `fnt export`), or any other directory with `force`,
never a run directory or the checkpoint itself.

The exported directory holds the base model's config, its tokenizer and the trained weights as
safetensors, so `AutoModelForCausalLM.from_pretrained(out)` loads the trained model anywhere.
A LoRA run's checkpoint (adapters only) exports as a PEFT adapter directory (adapter_config.json
naming the base, adapter_model.safetensors, the tokenizer), which `PeftModel.from_pretrained`
and vLLM's `--lora-modules` load on the base; with `merge` as a full model with the adapters
merged into its weights. Checkpoints saved by any number of ranks load here in one process (DCP
reshards on load).

torch and the model code are imported by the functions that read or write weights, so that
`export_hf_`, which `fnt export` calls, checks its inputs and creates the directory it writes
into before torch is imported: a bad checkpoint or --out answers at once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fnt.apps.preflight import check_export, export_marker
from fnt.config import LoraConfig, ModelConfig
from fnt.errors import CheckpointError
from fnt.model.tokenizer import load_tokenizer
from fnt.store.paths import require_checkpoint
from fnt.store.transaction import staged_dir_

if TYPE_CHECKING:
    from torch import nn


def saved_lora(ckpt_dir: Path) -> LoraConfig:
    """The adapters' settings a checkpoint records (off for a checkpoint without LoRA)."""
    from fnt.checkpoint import read_meta

    lora = read_meta(ckpt_dir).get("lora", {})
    return LoraConfig(**{key: tuple(v) if isinstance(v, list) else v for key, v in lora.items()})


def check_base(ckpt_dir: Path) -> str:
    """The base model directory of a checkpoint; a CheckpointError when a LoRA checkpoint's base
    has changed since (fnt.model.lora.base_fingerprint), so its adapters would adapt another
    model."""
    from fnt.checkpoint import read_meta
    from fnt.model.lora import base_fingerprint

    meta = read_meta(ckpt_dir)
    base, recorded = meta["model_name"], meta.get("base_fingerprint")
    if recorded is not None and base_fingerprint(base) != recorded:
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapters of the base model in {base}, which has changed "
            "since (its config.json or weights' index differ): put the original base back"
        )
    return base


def load_trained_model(ckpt_dir: Path) -> nn.Module:
    """The base model architecture with the checkpoint's weights, in float32, on CPU; for a
    LoRA checkpoint, the base read from its directory with the trained adapters added."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fnt.model.loading import load_hf_model
    from fnt.model.lora import add_adapters_

    ckpt_dir = Path(ckpt_dir)
    require_checkpoint(ckpt_dir, "")
    base = check_base(ckpt_dir)
    model = load_hf_model(ModelConfig(name=base, dtype="float32"), torch.device("cpu"))
    lora = saved_lora(ckpt_dir)
    if lora.rank:
        add_adapters_(model, lora)
    # What the checkpoint holds (fnt.checkpoint.held_state): every weight, or the trained ones.
    held = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {"model": {k: v for k, v in model.state_dict().items() if k in held or not lora.rank}}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"], strict=not lora.rank)
    return model.eval()


def export_hf_(
    ckpt_dir: Path,
    out_dir: Path,
    dtype: Optional[str] = None,
    merge: bool = False,
    force: bool = False,
) -> Path:
    """Export the checkpoint at `ckpt_dir` into `out_dir` (`write_hf_`), whole or not at all: the
    inputs are checked first (fnt.apps.preflight.check_export: `out_dir` must be new, empty, an
    earlier export, or replaced with `force`), then the directory is written beside it and
    renamed into place (fnt.store.transaction.staged_dir_). Returns the directory written."""
    check_export(ckpt_dir, out_dir, force)
    with staged_dir_(Path(out_dir), export_marker(ckpt_dir, dtype, merge), "--out") as partial:
        write_hf_(ckpt_dir, partial, dtype, merge=merge)
    return Path(os.path.realpath(out_dir))


def write_hf_(
    ckpt_dir: Path, out_dir: Path, dtype: Optional[str] = None, merge: bool = False
) -> None:
    """Write the trained model (optionally cast to `dtype`) and the base tokenizer into the
    existing directory out_dir: a full model, or for a LoRA checkpoint its PEFT adapter
    directory (`merge`: the full model with the adapters merged in)."""
    from fnt.checkpoint import read_meta
    from fnt.model.loading import DTYPES, without_tied_duplicates
    from fnt.model.lora import merge_adapters, save_adapter_

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    model = load_trained_model(ckpt_dir)
    lora = saved_lora(ckpt_dir)
    base = read_meta(ckpt_dir)["model_name"]
    cast = DTYPES[dtype] if dtype is not None else None
    if lora.rank and not merge:
        adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        save_adapter_(out_dir, model, {n: t.to(cast or t.dtype) for n, t in adapters.items()}, base)
    else:
        state = model.state_dict()
        if lora.rank:
            state = merge_adapters(state, lora)
        state = without_tied_duplicates(model, state)
        if cast is not None:
            state = {name: tensor.to(cast) for name, tensor in state.items()}
        model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    load_tokenizer(base).save_pretrained(out_dir)
