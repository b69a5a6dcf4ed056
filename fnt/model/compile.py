"""Regional compilation (model.compile): every decoder layer compiled with torch.compile, in
place. Side effects: `compile_layers_` sets each layer's compiled call (the compilation itself
happens on the layer's first call); `compile_totals` reads torch's process-wide compile counters.

Each layer is compiled with `nn.Module.compile`, which keeps the module where it is, so parameter
names, state dicts, checkpoints and exports are those of the eager model (no `_orig_mod.`), and
FSDP2 shards the compiled layer like any other (fnt.model.loading compiles before it shards).
All layers run the same code, and torch inlines the layers' parameters as graph inputs, so one
graph serves every layer: the cost of compiling does not grow with the depth.

Lengths: layers are compiled with `dynamic=True`, so the batch size and sequence length are
symbols from the first compile: SFT rows (always seq_len long) and RL micro-batches (row lengths
in multiples of fnt.rollout.pack.ROW_MULTIPLE, row counts that vary) reuse the graphs they have.
Torch still specializes on a few values of a size (0 and 1, and ranges its kernels choose
between) and on grad mode, so a run compiles a handful of graphs, at most `graph_limit()`
(torch._dynamo.config.recompile_limit, 8 unless changed) for the layers' code; a shape past that
bound runs eagerly, with torch's warning. Every row says what its step compiled:
`perf/compile_graphs` and `time/compile` (fnt.rows), which the throughput leaves out.

Generation (fnt.rollout.sampling) runs a prompt's prefill eagerly (`eager_layers`) and decodes
with the compiled layers only with fnt.model.decode_cache's cursor cache. transformers' caches
pick a layer's storage by its `layer_idx` (`self.layers[layer_idx]`), which torch compiles as a
constant, so with a DynamicCache or a StaticCache decoding compiled one graph per layer (also
with torch._dynamo.config.allow_unspec_int_on_nn_module, which makes the attribute a symbol
only to specialize it at the list index), and one more per layer when the cache length first
changed: 4 graphs for 2 layers, past the bound beyond four layers. The cursor cache keeps
decoding to one graph for all layers (two once the cache length changes), tokens identical.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class CompileTotals:
    """What this process has compiled so far (every torch.compile region, not only fnt's)."""

    graphs: int
    seconds: float

    def __sub__(self, earlier: CompileTotals) -> CompileTotals:
        return CompileTotals(self.graphs - earlier.graphs, self.seconds - earlier.seconds)


def compiles(setting: bool | str, device_type: str, ac: bool) -> bool:
    """Whether model.compile = `setting` compiles on `device_type`: "auto" compiles on CUDA,
    where it pays (an SFT step at a Qwen3-0.6B shape took 1.47x less time there), and not on a
    CPU, where a compile costs more than short runs save; nor with activation checkpointing,
    whose checkpointed layers torch.compile cannot trace."""
    if setting == "auto":
        return device_type == "cuda" and not ac
    return bool(setting)


def compile_layers_(layers: nn.ModuleList) -> None:
    """Compile every layer in place (`layer.compile(dynamic=True)`; see the module docstring)."""
    for layer in layers:
        layer.compile(dynamic=True)


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` has been called on this module."""
    return getattr(module, "_compiled_call_impl", None) is not None


@contextlib.contextmanager
def eager_layers(model: nn.Module) -> Iterator[None]:
    """Inside the block `model`'s compiled layers run their eager code and nothing compiles.
    torch's stance is process-wide, not per thread, so it is set only for a model that has
    compiled layers: the uncompiled background copy of rollout.async_level > 0, decoding in
    its own thread, must not switch the update's compiled layers to eager code meanwhile, nor
    leave the stance at eager when its block and another thread's overlap."""
    if not any(is_compiled(module) for module in model.modules()):
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def graph_limit() -> int:
    """The most graphs torch compiles for one code object (a decoder layer's forward) before
    running new shapes eagerly: torch._dynamo.config.recompile_limit (cache_size_limit before
    torch 2.7)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


def compile_totals() -> CompileTotals:
    """The graphs this process has compiled and the seconds spent compiling them (dynamo's
    `_compile.compile_inner`, which includes the backward's AOT compilation), since it started."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return CompileTotals(
        graphs=int(counters["stats"]["unique_graphs"]),
        seconds=float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
    )
