"""The model layer: loading, sharding, the forward pass's parts, LoRA and tokenizers. Loading
and sharding (loading, sharded_load, shards), what the forward pass is made of (attention,
lm_head, moe), LoRA adapters (lora), tokenizers and the tiny debug model. Side effects: its
modules' (reading model directories, building, sharding and compiling models in place, writing
the tiny model), each named in its module; shards is pure; this file only re-exports the names
of fnt.model.loading, imported on first use.

The names of `fnt.model.loading` stay importable from `fnt.model` (the module this package
replaced), loaded on first use so that importing a sibling stays light.
"""

from importlib import import_module
from importlib.util import find_spec


def __getattr__(name: str):
    # `from fnt.model import tiny_model` asks for the submodule's name first: import that
    # submodule alone, not loading (and torch with it).
    if not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:
        return import_module(f"{__name__}.{name}")
    loading = import_module("fnt.model.loading")
    try:
        return getattr(loading, name)
    except AttributeError:
        raise AttributeError(f"module 'fnt.model' has no attribute {name!r}") from None
