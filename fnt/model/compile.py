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

Generation (fnt.rollout.sampling) runs the layers eagerly (`eager_layers`): with a KV cache the
layer's code guards on its layer index and on the cache's state, so it would compile two or
more graphs per layer (prefill and decode), past the bound at four layers, after which new
shapes run eagerly anyway. Its tokens are those of the eager model. A static cache
(transformers' StaticCache, decode compiled, prefill eager) keeps the per-layer graphs:
`Cache.update(k, v, layer_idx)` indexes a Python list of per-layer caches with the layer's
`layer_idx` attribute, and torch guards on the index of a list (also with
torch._dynamo.config.allow_unspec_int_on_nn_module, which turns the attribute into a symbol only
to specialize it there), so decoding compiled one graph per layer, and one more per layer when
the cache length first changed (measured: 4 graphs for 2 layers, tokens identical, no faster).
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


def compile_layers_(layers: nn.ModuleList) -> None:
    """Compile every layer in place (`layer.compile(dynamic=True)`; see the module docstring)."""
    for layer in layers:
        layer.compile(dynamic=True)


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` has been called on this module."""
    return getattr(module, "_compiled_call_impl", None) is not None


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """Inside the block every compiled region runs its eager code and nothing compiles."""
    with torch.compiler.set_stance("force_eager"):
        yield


def graph_limit() -> int:
    """The most graphs torch compiles for one code object (a decoder layer's forward) before
    running new shapes eagerly: torch._dynamo.config.recompile_limit."""
    return int(torch._dynamo.config.recompile_limit)


def compile_totals() -> CompileTotals:
    """The graphs this process has compiled and the seconds spent compiling them (dynamo's
    `_compile.compile_inner`, which includes the backward's AOT compilation), since it started."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return CompileTotals(
        graphs=int(counters["stats"]["unique_graphs"]),
        seconds=float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
    )
