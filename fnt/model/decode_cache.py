"""A KV cache that compiled decoder layers decode with in a bounded number of graphs
(fnt.model.compile). Side effects: `decode_cache` allocates nothing; the cache allocates its
storage on the first update and then writes to it in place.

transformers' caches pick a layer's storage with `self.layers[layer_idx]`, and torch compiles
a list index as a constant, so a compiled layer calling `cache.update(k, v, layer_idx)` compiles
one graph per layer (and a static cache does not change that). `LayerCursorCache` never looks at
`layer_idx`: every layer's keys and values live in one tensor [B, H, L * S, D] (S: the cache's
capacity), and a 0-d tensor cursor says which layer's slice the next update writes and reads
(the layers run in order, once each per forward); another 0-d tensor counts the tokens stored.
Both are tensors, so all layers run the same graph, and so do decode steps at every position.
Reading a layer's keys copies its slice (index_select), which costs a copy of the cache per
layer and step: the price of one graph instead of one per layer.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn
from transformers import DynamicCache, StaticCache

from fnt.model.compile import is_compiled
from fnt.model.loading import decoder_layers


class LayerCursorCache(StaticCache):
    """Every layer's keys and values of `max_cache_len` tokens in one tensor; see the module
    docstring. Masks are built for all `max_cache_len` positions (a StaticCache's sizes)."""

    def __init__(self, config, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.num_layers, self.capacity = len(self.layers), max_cache_len
        self.cursor = torch.zeros((), dtype=torch.int64)
        self.length = torch.zeros((), dtype=torch.int64)
        self.keys_all: Union[Tensor, None] = None
        self.values_all: Union[Tensor, None] = None

    def get_seq_length(self, layer_idx: int = 0) -> Tensor:
        return self.length

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.keys_all is None:  # on the first (prefill) forward, which runs eagerly
            self._allocate(key_states, value_states)
        new = key_states.shape[-2]
        start = self.cursor * self.capacity
        slots = start + self.length + torch.arange(new, device=key_states.device)
        self.keys_all.index_copy_(2, slots, key_states)
        self.values_all.index_copy_(2, slots, value_states)
        window = start + torch.arange(self.capacity, device=key_states.device)
        keys = self.keys_all.index_select(2, window)
        values = self.values_all.index_select(2, window)
        # The last layer's update ends the forward: the tokens are stored in every layer now.
        self.length.add_(new * (self.cursor == self.num_layers - 1).to(torch.int64))
        self.cursor.copy_((self.cursor + 1) % self.num_layers)
        return keys, values

    def _allocate(self, key_states: Tensor, value_states: Tensor) -> None:
        rows, heads, _, key_dim = key_states.shape
        size = self.num_layers * self.capacity
        self.keys_all = key_states.new_zeros((rows, heads, size, key_dim))
        self.values_all = value_states.new_zeros((rows, heads, size, value_states.shape[-1]))
        self.cursor = self.cursor.to(key_states.device)
        self.length = self.length.to(key_states.device)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys_all = self.keys_all.repeat_interleave(repeats, dim=0)
        self.values_all = self.values_all.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.keys_all, self.values_all = self.keys_all[indices], self.values_all[indices]


def decode_cache(model: nn.Module, max_tokens: int) -> Union[DynamicCache, LayerCursorCache]:
    """The cache to generate at most `max_tokens` tokens (prompt included) with: a
    LayerCursorCache when the model's decoder layers are compiled (model.compile), so decoding
    compiles a bounded number of graphs; else (and for sliding-window attention, which the
    cursor cache does not implement) transformers' DynamicCache."""
    if compiles_decoding(model):
        cache = LayerCursorCache(model.config, max_tokens)
        if not any(cache.is_sliding):
            return cache
    return DynamicCache(config=model.config)


def compiles_decoding(model: nn.Module) -> bool:
    """Whether the model's decoder layers are compiled (model.compile)."""
    try:
        layers = decoder_layers(model)
    except ValueError:  # not a model.layers architecture: nothing of it was compiled by fnt
        return False
    return len(layers) > 0 and all(is_compiled(layer) for layer in layers)
