"""What the model's attention needs to keep packed documents apart, by kernel. Pure.

A packed row holds several documents; a token may attend only to earlier tokens of its own
document. How the model is told depends on `model.attn_implementation`:

- `sdpa` and `eager` take an explicit block-diagonal causal mask [B, 1, T, T] (boolean for sdpa,
  additive float for eager, which adds it to its scores). Restarted position ids alone do not
  isolate documents on these paths in transformers.
- The flash-attention kernels (`flash_attention_2`, `flash_attention_3`) are varlen kernels:
  fnt passes the documents' boundaries over the flattened micro-batch (`cu_seq_lens_q/k`, the
  cumulative document lengths, and `max_length_q/k`), which transformers hands to the kernel
  as they are. No mask is passed, so nothing of size T x T exists, and the cost follows the
  documents, not the row. (transformers can infer the boundaries from restarted position ids
  too, but only for one row, and with a host sync in every layer.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fnt.batch import PackedRows, block_causal_mask

VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3")


def attention_kernel(model: nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "sdpa"


def attention_mask_for(model: nn.Module, rows: PackedRows) -> Tensor:
    """The block-causal mask in the form an sdpa or eager kernel honours (see the module doc)."""
    mask = block_causal_mask(rows.document_ids)
    if attention_kernel(model) == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask


def document_boundaries(document_ids: Tensor) -> tuple[Tensor, int]:
    """Cumulative document lengths [D + 1] int32 over the flattened rows (a row always starts a
    document) and the longest document's length (one host sync)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    total = torch.tensor([document_ids.numel()], device=document_ids.device)
    cumulative = torch.cat([first, total]).to(torch.int32)
    return cumulative, int(cumulative.diff().max())


def packed_inputs(model: nn.Module, rows: PackedRows) -> dict[str, Any]:
    """Keyword arguments of the model's forward over packed rows, documents kept apart."""
    inputs: dict[str, Any] = {
        "input_ids": rows.input_ids,
        "position_ids": rows.position_ids,
        "use_cache": False,
    }
    if attention_kernel(model) in VARLEN_KERNELS:
        cumulative, longest = document_boundaries(rows.document_ids)
        inputs.update(
            cu_seq_lens_q=cumulative,
            cu_seq_lens_k=cumulative,
            max_length_q=longest,
            max_length_k=longest,
        )
    else:
        inputs["attention_mask"] = attention_mask_for(model, rows)
    return inputs
