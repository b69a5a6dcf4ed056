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
from fnt.tokenizer import load_tokenizer
from fnt.transaction import COMPLETE_MARKER, is_complete


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


def export_hf(ckpt_dir: Path, out_dir: Path, dtype: Optional[str] = None) -> Path:
    """Write the trained model (optionally cast to `dtype`) and the base tokenizer to out_dir."""
    model = load_trained_model(ckpt_dir)
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(read_meta(Path(ckpt_dir))["model_name"]).save_pretrained(out_dir)
    return out_dir
