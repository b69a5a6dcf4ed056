"""The model layer: loading, sharding, the forward pass's parts, LoRA and tokenizers. Loading
and sharding (loading, sharded_load, shards), what the forward pass is made of (attention,
lm_head, moe), LoRA adapters (lora), tokenizers and the tiny debug model.

The names of `fnt.model.loading` stay importable from `fnt.model` (the module this package
replaced), loaded on first use so that importing a sibling stays light.
"""

from importlib import import_module


def __getattr__(name: str):
    loading = import_module("fnt.model.loading")
    try:
        return getattr(loading, name)
    except AttributeError:
        raise AttributeError(f"module 'fnt.model' has no attribute {name!r}") from None
