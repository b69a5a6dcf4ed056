"""How the model's attention keeps packed documents apart, by kernel: one table. Pure, except
`register_kernels_` (adds fnt's attention functions to transformers' registry, once a process;
`hf_attention_name` calls it) and `decoding_attention` (switches a model's kernel inside its block).

A packed row holds several documents; a token may attend only to earlier tokens of its own
document. `KERNELS` says, for each `model.attn_implementation`, how the documents reach the
kernel and where it runs:

- boundaries: the varlen kernels (`varlen`, torch's own `torch.nn.attention.varlen`;
  `flash_attention_2` and `flash_attention_3` from the flash-attn packages) get the documents'
  cumulative lengths over the flattened micro-batch (`cu_seq_lens_q/k`) and the longest
  document's length (`max_length_q/k`), read on the host from the batch before it is moved
  (fnt.batch.RowLayout). No mask is passed, nothing of size T x T exists, and the cost follows
  the documents, not the row.
- blocks: `flex` (torch's FlexAttention, compiled) gets a BlockMask built on the host from the
  same document lengths (`document_block_mask`): which 128 x 128 tiles of the row's attention
  hold a visible pair, and which of those are wholly visible; a mask function of the document
  ids masks the others. Nothing of size T x T exists either, and the tiles no token sees are
  skipped: the packed-document kernel of a torch older than the varlen one, without flash-attn.
- mask: `sdpa` and `eager` take an explicit block-diagonal causal mask [B, 1, T, T] (boolean for
  sdpa, additive float for eager): the last fallback, for CPUs. A micro-batch whose rows each
  hold one document takes sdpa's causal path with no mask at all.

`auto` (the default) is the first kernel of `AUTO_ORDER[device type]` that this machine offers
(`kernel_problem` is None): on CUDA flash-attn 3 when installed, torch's varlen, flash-attn 2,
FlexAttention, then sdpa; on a CPU sdpa. The start-up summary names the kernel.

fnt's own attention functions (`fnt_varlen`, `fnt_flex`, `fnt_sdpa`) are registered with
transformers' AttentionInterface only, not with its mask functions: transformers then builds
no mask and never inspects the position ids for packed sequences (which reads a value back
from the device), and the function gets exactly what fnt passes. Generation with a KV cache
and padding needs transformers' masks, so `fnt.rollout.sampling` decodes inside
`decoding_attention`, which switches such a model to transformers' sdpa for the block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import Tensor, nn

from fnt.batch import PackedRows, RowLayout, block_causal_mask, row_layout


@dataclass(frozen=True)
class AttentionKernel:
    """One row of the kernel table."""

    documents: str
    """How packed documents reach the kernel: "boundaries" (cu_seq_lens), "blocks" (a
    BlockMask) or "mask" (T x T)."""
    devices: tuple[str, ...]
    """The device types it runs on."""
    hf_name: str
    """The name set as the model's `_attn_implementation` (transformers' own, or fnt's)."""
    needs: Optional[Callable[[], Optional[str]]] = None
    """Why it cannot run in this process (a missing package or torch API), or None."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    """The compute dtypes it takes (flash kernels: 16-bit only)."""


def _module_problem(module: str, package: str) -> Callable[[], Optional[str]]:
    def problem() -> Optional[str]:
        if importlib.util.find_spec(module) is None:
            return f"needs the {package} package"
        return None

    return problem


def _torch_varlen_problem() -> Optional[str]:
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"needs torch.nn.attention.varlen (torch >= 2.10; this is {torch.__version__})"
    return None


def _flex_problem() -> Optional[str]:
    why = f"(torch >= 2.6; this is {torch.__version__})"
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"needs torch.nn.attention.flex_attention {why}"
    from torch.nn.attention.flex_attention import BlockMask

    if "seq_lengths" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
        return f"needs BlockMask.from_kv_blocks(seq_lengths=) {why}"
    return None


HALF = ("bfloat16", "float16")

KERNELS: dict[str, AttentionKernel] = {
    "varlen": AttentionKernel("boundaries", ("cuda",), "fnt_varlen", _torch_varlen_problem, HALF),
    "flash_attention_3": AttentionKernel(
        "boundaries",
        ("cuda",),
        "flash_attention_3",
        _module_problem("flash_attn_interface", "flash-attn 3 (flash_attn_interface)"),
        HALF,
    ),
    "flash_attention_2": AttentionKernel(
        "boundaries",
        ("cuda",),
        "flash_attention_2",
        _module_problem("flash_attn", "flash-attn"),
        HALF,
    ),
    # FlexAttention has no backward on a CPU: training there is refused.
    "flex": AttentionKernel("blocks", ("cuda",), "fnt_flex", _flex_problem),
    "sdpa": AttentionKernel("mask", ("cpu", "cuda"), "fnt_sdpa"),
    "eager": AttentionKernel("mask", ("cpu", "cuda"), "eager"),
}

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attention_3", "varlen", "flash_attention_2", "flex", "sdpa"),
    "cpu": ("sdpa",),
}
"""The kernels "auto" tries, fastest first, per device type (another device type gets sdpa)."""

# The decoding twin of fnt's own functions: transformers' kernel, with its masks.
_DECODING = {"fnt_varlen": "sdpa", "fnt_flex": "sdpa", "fnt_sdpa": "sdpa"}


def kernel_problem(name: str, device_type: str, dtype: str = "bfloat16") -> Optional[str]:
    """Why kernel `name` cannot run on `device_type` computing in `dtype` here, or None."""
    kernel = KERNELS[name]
    if device_type not in kernel.devices:
        return f"runs on {' and '.join(kernel.devices)} only, not on {device_type}"
    if dtype not in kernel.dtypes:
        return f"computes in {' or '.join(kernel.dtypes)} only, not {dtype}"
    return kernel.needs() if kernel.needs is not None else None


def resolve_kernel(name: str, device_type: str, dtype: str) -> str:
    """The kernel `model.attn_implementation = name` means on `device_type` computing in
    `dtype`: `name` itself, or for "auto" the first kernel of AUTO_ORDER that can run here."""
    if name != "auto":
        return name
    for candidate in AUTO_ORDER.get(device_type, ("sdpa",)):
        if kernel_problem(candidate, device_type, dtype) is None:
            return candidate
    return "sdpa"


def hf_attention_name(name: str) -> str:
    """What to pass to transformers as `attn_implementation` for kernel `name` (registering
    fnt's own functions first)."""
    register_kernels_()
    return KERNELS[name].hf_name


def attention_kernel(model: nn.Module) -> str:
    """The table's name of the kernel the model runs (transformers' name when it is none of
    the table's)."""
    hf_name = getattr(model.config, "_attn_implementation", None) or "sdpa"
    return next((k for k, v in KERNELS.items() if v.hf_name == hf_name), hf_name)


_VARLEN_PARAMETERS: frozenset[str] = frozenset()


def _varlen_parameters() -> frozenset[str]:
    """torch's varlen_attn's parameter names, read when the kernels are registered (so that a
    compiled layer sees a constant, not a signature to inspect)."""
    return _VARLEN_PARAMETERS


def varlen_options(parameters: frozenset[str], groups: int) -> tuple[dict[str, Any], bool]:
    """The keyword arguments that make torch's varlen_attn causal, and whether key/value heads
    must be repeated `groups` times first: the signature changed between torch releases (an
    `is_causal` flag, later a `window_size` whose (-1, 0) is causal; `enable_gqa` from 2.13)."""
    options: dict[str, Any] = {}
    if "is_causal" in parameters:
        options["is_causal"] = True
    elif "window_size" in parameters:
        options["window_size"] = (-1, 0)
    else:
        raise RuntimeError("torch's varlen_attn takes neither is_causal nor window_size")
    repeat = groups > 1 and "enable_gqa" not in parameters
    if groups > 1 and not repeat:
        options["enable_gqa"] = True
    return options, repeat


def refuse_what_it_cannot_do(
    kernel: str,
    documents: str,
    given: bool,
    module: nn.Module,
    dropout: float,
    sliding_window: Optional[int],
) -> None:
    """ValueError where one of fnt's own kernels is called for what it cannot do: without the
    documents' `documents`, which fnt passes in training forwards only (`given`), with
    attention dropout in training, or with a sliding window."""
    if not given:
        raise ValueError(
            f"the {kernel} kernel needs the documents' {documents}, which fnt passes in training "
            "forwards; decode inside fnt.model.attention.decoding_attention(model)"
        )
    if dropout and module.training:
        raise ValueError(f"the {kernel} kernel has no attention dropout: use sdpa")
    if sliding_window is not None:
        raise ValueError(
            f"the {kernel} kernel has no sliding window: use sdpa or flash_attention_2"
        )


def fnt_varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function protocol over torch's varlen_attn: query [B, H, T, D],
    key and value [B, Hkv, T, D], the documents as `cu_seq_lens_q` [D + 1] int32 and
    `max_length_q` (fnt.model.attention.packed_inputs); returns [B, T, H, D]."""
    from torch.nn.attention.varlen import varlen_attn

    refuse_what_it_cannot_do(
        "varlen", "boundaries (cu_seq_lens_q)", "cu_seq_lens_q" in kwargs, module, dropout,
        sliding_window,
    )  # fmt: skip
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    options, repeat = varlen_options(_varlen_parameters(), groups)
    # Under autocast a float32 norm (Qwen3's q/k norms) can leave query and key in float32
    # beside a bfloat16 value; the kernel takes one 16-bit dtype, as sdpa's autocast gives it.
    dtype = compute_dtype(query, key, value)
    q = query.transpose(1, 2).reshape(B * T, H, D).to(dtype)
    k = key.transpose(1, 2).reshape(B * T, key.shape[1], D).to(dtype)
    v = value.transpose(1, 2).reshape(B * T, value.shape[1], D).to(dtype)
    if repeat:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **options)
    return out.reshape(B, T, H, D), None


BLOCK = 128
"""The side of FlexAttention's tiles (its default sparse block size)."""


def document_tiles(lengths: tuple[int, ...], block: int = BLOCK) -> tuple[list, list]:
    """For one row of documents of `lengths` (in order, T tokens in all), per query tile i (the
    queries [i * block, (i + 1) * block)): the key tiles some of whose keys a query of the tile
    sees (its own document's, not later ones), in two lists: those it sees only in part (the
    tiles on the diagonal or crossing a document's edge), and those every query of the tile
    sees whole. Pure."""
    starts = np.cumsum([0, *lengths])
    total = int(starts[-1])
    tiles = -(-total // block)
    partial: list[list[int]] = []
    whole: list[list[int]] = []
    for i in range(tiles):
        first, last = i * block, min((i + 1) * block, total) - 1
        doc_first = int(np.searchsorted(starts, first, side="right")) - 1
        doc_last = int(np.searchsorted(starts, last, side="right")) - 1
        in_one = doc_first == doc_last
        lo, hi = int(starts[doc_first]), int(starts[doc_last + 1])
        partial.append([])
        whole.append([])
        for j in range(lo // block, i + 1):
            key_lo, key_hi = j * block, min((j + 1) * block, total)
            seen_whole = in_one and j < i and key_lo >= lo and key_hi <= hi
            (whole if seen_whole else partial)[i].append(j)
    return partial, whole


def document_block_mask(layout: RowLayout, document_ids: Tensor) -> Any:
    """The FlexAttention BlockMask of packed rows: their tiles from the host layout
    (`document_tiles`), a mask function of the rows' document ids (same document, not later)
    for the tiles seen in part. Built on the host and copied without waiting."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = document_ids.shape
    tiles = -(-T // BLOCK)
    counts = np.zeros((2, B, 1, tiles), dtype=np.int32)
    indices = np.zeros((2, B, 1, tiles, tiles), dtype=np.int32)
    for b, lengths in enumerate(layout.document_lengths):
        for kind, lists in enumerate(document_tiles(lengths)):
            for i, seen in enumerate(lists):
                counts[kind, b, 0, i] = len(seen)
                indices[kind, b, 0, i, : len(seen)] = seen
    device = document_ids.device

    def moved(array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    def same_document_not_later(b, h, q, kv):
        return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)

    return BlockMask.from_kv_blocks(
        moved(counts[0]),
        moved(indices[0]),
        moved(counts[1]),
        moved(indices[1]),
        BLOCK,
        same_document_not_later,
        seq_lengths=(T, T),
    )


_COMPILED_FLEX: Optional[Callable] = None
"""torch's flex_attention compiled (eager, it computes every score), made where CUDA is when the
kernels are registered: a compiled layer reads a module global, not a cached call that torch
would trace and warn about."""


def fnt_flex_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function protocol over FlexAttention: query [B, H, T, D], key
    and value [B, Hkv, T, D], the documents as the BlockMask `document_block_mask` made (passed
    as the attention mask); returns [B, T, H, D]. Compiled on CUDA; elsewhere torch's eager
    reference (forward only: FlexAttention has no backward on a CPU)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    refuse_what_it_cannot_do(
        "flex", "BlockMask", isinstance(attention_mask, BlockMask), module, dropout,
        sliding_window,
    )  # fmt: skip
    dtype = compute_dtype(query, key, value)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    flex = _COMPILED_FLEX if q.is_cuda and _COMPILED_FLEX is not None else flex_attention
    grouped = q.shape[1] != k.shape[1]
    out = flex(q, k, v, block_mask=attention_mask, scale=scaling, enable_gqa=grouped)
    return out.transpose(1, 2).contiguous(), None


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The 16-bit dtype among the tensors, else autocast's where it is on, else their own."""
    for t in tensors:
        if t.dtype in (torch.bfloat16, torch.float16):
            return t.dtype
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensors[0].dtype


def fnt_sdpa_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa function, registered under fnt's name so that transformers builds no
    mask for it: the dense block-causal mask when fnt passes one, else the causal path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@cache
def register_kernels_() -> None:
    """Add fnt's attention functions to transformers' AttentionInterface (not to its masks)."""
    from transformers import AttentionInterface

    global _VARLEN_PARAMETERS, _COMPILED_FLEX
    if _torch_varlen_problem() is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters)
    if torch.cuda.is_available():  # compiling is CUDA's: a CPU run would only import dynamo
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention)
    AttentionInterface.register("fnt_varlen", fnt_varlen_attention)
    AttentionInterface.register("fnt_flex", fnt_flex_attention)
    AttentionInterface.register("fnt_sdpa", fnt_sdpa_attention)


@contextlib.contextmanager
def decoding_attention(model: nn.Module) -> Iterator[None]:
    """Inside the block a model on one of fnt's own attention functions runs transformers' twin
    of it (sdpa), whose masks honour a KV cache and padding; others are left as they are."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    twin = _DECODING.get(current)
    if twin is None:
        yield
        return
    config._attn_implementation = twin
    try:
        yield
    finally:
        config._attn_implementation = current


def document_boundaries(layout: RowLayout, device: torch.device) -> tuple[Tensor, int]:
    """Cumulative document lengths [D + 1] int32 over the flattened rows, on `device`, and the
    longest document's length: from the host layout, so nothing is read back."""
    lengths = [n for row in layout.document_lengths for n in row]
    cumulative = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return cumulative.to(device, non_blocking=True), max(lengths)


def attention_mask_for(model: nn.Module, rows: PackedRows) -> Tensor:
    """The block-causal mask in the form an sdpa or eager kernel honours (see the module doc)."""
    mask = block_causal_mask(rows.document_ids)
    if attention_kernel(model) == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask


def packed_inputs(model: nn.Module, rows: PackedRows) -> dict[str, Any]:
    """Keyword arguments of the model's forward over packed rows, documents kept apart."""
    inputs: dict[str, Any] = {
        "input_ids": rows.input_ids,
        "position_ids": rows.position_ids,
        "use_cache": False,
    }
    name = attention_kernel(model)
    kernel = KERNELS.get(name)
    if kernel is not None and kernel.documents == "boundaries":
        cumulative, longest = document_boundaries(row_layout(rows), rows.input_ids.device)
        inputs.update(
            cu_seq_lens_q=cumulative,
            cu_seq_lens_k=cumulative,
            max_length_q=longest,
            max_length_k=longest,
        )
    elif kernel is not None and kernel.documents == "blocks":
        inputs["attention_mask"] = document_block_mask(row_layout(rows), rows.document_ids)
    elif name == "sdpa" and row_layout(rows).one_document_per_row:
        inputs["attention_mask"] = None  # every row one document: sdpa's causal path
    else:
        inputs["attention_mask"] = attention_mask_for(model, rows)
    return inputs
