"""Checkpoint -> Hugging Face directory. Side effects: reads a checkpoint, writes a directory.

The exported directory holds the base model's config, its tokenizer and the trained weights as
safetensors, so `AutoModelForCausalLM.from_pretrained(out)` loads the trained model anywhere.
Checkpoints saved by any number of ranks load here in one process (DCP reshards on load).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fnt.checkpoint import read_meta
from fnt.config import ModelConfig
from fnt.model import DTYPES, load_hf_model
from fnt.rundir import COMPLETE_MARKER
from fnt.tokenizer import load_tokenizer
from fnt.transaction import is_complete


def load_trained_model(ckpt_dir: Path) -> nn.Module:
    """The base model architecture with the checkpoint's weights, in float32, on CPU."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir):
        raise FileNotFoundError(
            f"{ckpt_dir} is not a complete checkpoint (no {COMPLETE_MARKER} file)"
        )
    base = read_meta(ckpt_dir)["model_name"]
    model = load_hf_model(ModelConfig(name=base, dtype="float32"), torch.device("cpu"))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model


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


def export_hf_(ckpt_dir: Path, out_dir: Path, dtype: Optional[str] = None) -> Path:
    """Write the trained model (optionally cast to `dtype`) and the base tokenizer to out_dir."""
    model = load_trained_model(ckpt_dir)
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(read_meta(Path(ckpt_dir))["model_name"]).save_pretrained(out_dir)
    return out_dir
