"""Sampling completions from a causal LM with a KV cache. Side effects: forward passes of the
given model under torch.no_grad() (its weights and mode are left as they are) and draws from the
given torch.Generators.

All completions of all prompts decode together as one batch. The prompts are left-padded to the
longest one and run once, with an attention mask that hides the padding and position ids that
start at 0 at each prompt's first real token; the KV cache is then repeated for each prompt's
completions, and every new token is one forward pass of the still-running completions. A
completion that emits a stop token leaves the batch (its cache rows are dropped).

Sampling stays a function of each prompt's own generator: the token of a row is
argmax(p / q) over the vocabulary, q ~ Exp(1) drawn from its prompt's generator for that
prompt's running rows (the exponential race, which samples from p exactly; it is the draw
torch.multinomial makes for one sample per row). A prompt's draws therefore do not depend on
which other prompts share the batch, and neither do its samples, up to the last float bits in
which a padded batched forward may differ from a forward of the prompt alone.

Continuing a sequence (multi-turn episodes): with keep_caches, every completion carries the KV
cache of its prompt and its tokens but the last one (`RowCache`, the padding taken out), and a
later call given that cache for a prompt that extends those tokens feeds the model only the
tokens after them. The cached rows are left-padded to the longest cached row and the new tokens
to the longest new part, so a row's attention mask may have a hole of padding between its
cached and its new tokens; the position ids continue each row's own count. Only caches whose
layers all keep every token (transformers' DynamicLayer) are kept: a sliding-window layer drops
old tokens, and such a model's completions carry no cache (the next call prefills everything).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Optional, Union

import torch
from torch import Tensor, nn

from fnt.model.attention import decoding_attention
from fnt.model.compile import eager_layers


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: tuple[int, ...]
    """The generated tokens; the last one is a stop token when `stopped`."""
    logprobs: tuple[float, ...]
    """Per generated token, log-softmax(logits / temperature) at that token, computed in float32."""
    stopped: bool
    """True when the model emitted a stop token, False when max_new_tokens cut it off."""
    cache: Optional["RowCache"] = field(default=None, compare=False, repr=False)
    """With generate(keep_caches=True): the KV cache of the prompt and every generated token
    but the last (which the model has not read yet), to continue from; else None."""


@dataclass(frozen=True, eq=False)
class RowCache:
    """The KV cache of one sequence, without padding: per layer, keys and values [heads,
    len(token_ids), head_dim] of the tokens `token_ids`, at positions 0 .. len - 1."""

    token_ids: tuple[int, ...]
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]


def turn_seed(seed: int, step: int, slot: int, index: int, turn: int) -> int:
    """A 63-bit generator seed for turn `turn` (from 2: the first is the group's, drawn from
    `sampling_seed`) of episode `index` of a prompt slot of one step."""
    key = f"rollout/{seed}/{step}/{slot}/{index}/{turn}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def sampling_seed(seed: int, step: int, slot: int) -> int:
    """A 63-bit generator seed for the completions of one prompt slot of one step.

    `slot` is the prompt's index among the step's global prompts, so the samples depend on
    (seed, step, rank) through rank's share of the slots, and not on how many ranks there are.
    """
    digest = hashlib.blake2b(f"rollout/{seed}/{step}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@cache
def _cache_keyword(model_class: type) -> str:
    # transformers 5.x renamed the forward's `past_key_values` to `cache`; the old name still
    # works there but warns. Older releases (pyproject allows >= 4.56) know only the old name.
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    kv_cache,
    compiled: bool = False,
) -> Tensor:
    # Compiled layers (model.compile) run compiled only when `compiled`: decoding one token with
    # a cache that keeps them to one graph (fnt.model.decode_cache). A prompt's prefill, whose
    # lengths vary freely, and a DynamicCache, which compiles a graph per layer, run them eagerly.
    with contextlib.nullcontext() if compiled else eager_layers(model), decoding_attention(model):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{_cache_keyword(type(model)): kv_cache},
        )
    return out.logits[:, -1].float()


def left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """The prompts left-padded to the longest: input ids, attention mask (1 on real tokens) and
    position ids (0 at each prompt's first real token, 0 on the padding), all [P, W] int64."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def exponential_race(
    logp: Tensor, row_prompt: Tensor, generators: Sequence[Optional[torch.Generator]]
) -> Tensor:
    """One token per row sampled from softmax = exp(logp) [R, V]: argmax(p / q), q ~ Exp(1).

    `row_prompt` [R] (ascending) says whose generator draws each row's q: every prompt draws
    its running rows' noise in one call, as torch.multinomial would for that prompt alone.
    """
    counts = torch.bincount(row_prompt, minlength=len(generators)).tolist()
    noise = [
        torch.empty((n, logp.shape[-1]), dtype=logp.dtype, device=logp.device).exponential_(
            1.0, generator=generators[p]
        )
        for p, n in enumerate(counts)
        if n
    ]
    return (logp.exp() / torch.cat(noise)).argmax(dim=-1)


def cached_prefix(
    caches: Sequence[Optional[RowCache]], config, device: torch.device
) -> tuple[object, Tensor, Tensor]:
    """The rows' caches left-padded to the longest into one DynamicCache, their attention mask
    [P, C] (1 on cached tokens) and their lengths [P]; a None row is all padding."""
    from transformers import DynamicCache

    lengths = [0 if c is None else len(c.token_ids) for c in caches]
    width = max(lengths)
    mask = torch.zeros((len(caches), width), dtype=torch.int64)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    some = next(c for c in caches if c is not None)
    kv_cache = DynamicCache(config=config)
    for layer in range(len(some.keys)):
        heads, _, dim = some.keys[layer].shape
        keys = some.keys[layer].new_zeros((len(caches), heads, width, dim))
        values = some.values[layer].new_zeros((len(caches), heads, width, dim))
        for row, c in enumerate(caches):
            if c is not None:
                keys[row, :, width - lengths[row] :] = c.keys[layer]
                values[row, :, width - lengths[row] :] = c.values[layer]
        kv_cache.update(keys, values, layer)
    return kv_cache, mask.to(device), torch.tensor(lengths, dtype=torch.int64, device=device)


def keeps_every_token(kv_cache) -> bool:
    """Whether every layer of the cache holds all tokens read (RowCache can be cut from it)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # a transformers whose caches have no layer objects: no row caches
        return False
    layers = getattr(kv_cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def row_cache(kv_cache, row: int, attention_row: Tensor) -> tuple[tuple, tuple]:
    """The keys and values of batch row `row` of the cache at its real tokens (attention 1)."""
    real = attention_row.nonzero().squeeze(-1)  # found once for all layers (a device sync)
    keys = tuple(layer.keys[row].index_select(1, real) for layer in kv_cache.layers)
    values = tuple(layer.values[row].index_select(1, real) for layer in kv_cache.layers)
    return keys, values


def checked_arguments(
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_new_tokens: Union[int, Sequence[int]],
    stop_token_ids: Collection[int],
    temperature: float,
    generators: Optional[Sequence[Optional[torch.Generator]]],
    caches: Optional[Sequence[Optional[RowCache]]],
) -> tuple[Sequence[int], Sequence[Optional[torch.Generator]], Sequence[Optional[RowCache]]]:
    """`generate`'s arguments checked (ValueError naming the first bad one), as one limit, one
    generator and one cache per prompt (None where none is given). Pure."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
    if num_samples < 1 or len(limits) != len(prompts) or min(limits, default=1) < 1:
        raise ValueError(
            f"need num_samples >= 1 and max_new_tokens >= 1 (one, or one per prompt), got "
            f"{num_samples}, {max_new_tokens}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not prompts or not all(prompts):
        raise ValueError("no prompts, or an empty prompt")
    if not stop_token_ids:
        raise ValueError("stop_token_ids is empty: generation needs a token to stop at")
    if generators is None:
        generators = [None] * len(prompts)
    if len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts")
    if caches is None or all(c is None for c in caches):
        caches = [None] * len(prompts)
    elif len(caches) != len(prompts):
        raise ValueError(f"{len(caches)} caches for {len(prompts)} prompts")
    for i, (prompt, c) in enumerate(zip(prompts, caches)):
        if c is not None and (
            len(c.token_ids) >= len(prompt) or tuple(prompt[: len(c.token_ids)]) != c.token_ids
        ):
            raise ValueError(
                f"the cache of prompt {i} is not of a proper prefix of it (its {len(c.token_ids)} "
                f"tokens, the prompt's {len(prompt)})"
            )
    return limits, generators, caches


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int,
    max_new_tokens: Union[int, Sequence[int]],
    stop_token_ids: Collection[int],
    temperature: float = 1.0,
    greedy: bool = False,
    generators: Optional[Sequence[Optional[torch.Generator]]] = None,
    caches: Optional[Sequence[Optional[RowCache]]] = None,
    keep_caches: bool = False,
) -> list[list[Completion]]:
    """Per prompt, `num_samples` completions, each ending at a stop token or after max_new_tokens
    (one number for all, or one per prompt: a row that reaches its own limit leaves the batch).

    Sampling draws from softmax(logits / temperature), prompt i's rows with `generators[i]` (on
    the model's device; None, or a None entry, draws from torch's default generator); `greedy`
    takes the most likely token instead (and draws nothing). The recorded logprobs are
    log-softmax(logits / temperature) either way. Put the model in eval mode first.

    `caches[i]` (a Completion's `cache` from an earlier call, or None) holds prompt i's first
    tokens already read: only the tokens after them are fed. `keep_caches` gives every
    completion its `cache` (module docstring).
    """
    limits, generators, caches = checked_arguments(
        prompts,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        generators=generators,
        caches=caches,
    )
    from fnt.model.decode_cache import LayerCursorCache, decode_cache

    device = next(model.parameters()).device
    stops = torch.tensor(sorted(stop_token_ids), dtype=torch.int64, device=device)
    pad_id = int(stops[0])  # hidden by the attention mask, so any valid id will do
    if any(c is not None for c in caches):
        kv_cache, cached, starts = cached_prefix(caches, model.config, device)
        news = [p[0 if c is None else len(c.token_ids) :] for p, c in zip(prompts, caches)]
        ids, attention, positions = left_padded(news, pad_id, device)
        positions = positions + starts[:, None]
        attention = torch.cat([cached, attention], dim=1)
    else:
        ids, attention, positions = left_padded(prompts, pad_id, device)
        kv_cache = decode_cache(model, ids.shape[1] + max(limits))
    compiled = isinstance(kv_cache, LayerCursorCache)
    logits = _last_logits(model, ids, attention, positions, kv_cache)
    keep_caches = keep_caches and keeps_every_token(kv_cache)
    kv_cache.batch_repeat_interleave(num_samples)
    logits = logits.repeat_interleave(num_samples, dim=0)
    attention = attention.repeat_interleave(num_samples, dim=0)
    next_position = positions[:, -1:].repeat_interleave(num_samples, dim=0) + 1

    rows, longest = len(prompts) * num_samples, max(limits)
    row_limits = torch.tensor(limits, dtype=torch.int64, device=device)
    row_limits = row_limits.repeat_interleave(num_samples)
    tokens = torch.zeros((rows, longest), dtype=torch.int64, device=device)
    logprobs = torch.zeros((rows, longest), dtype=torch.float32, device=device)
    lengths = row_limits.clone()
    running = torch.arange(rows, device=device)  # which completion each batch row is
    kept: dict[int, tuple[tuple, tuple]] = {}  # completion row -> its cache's keys and values
    for t in range(longest):
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if greedy:
            chosen = logp.argmax(dim=-1)
        else:
            chosen = exponential_race(logp, running // num_samples, generators)
        tokens[running, t] = chosen
        logprobs[running, t] = logp.gather(-1, chosen[:, None]).squeeze(-1)
        stopped = torch.isin(chosen, stops)
        lengths[running[stopped]] = t + 1
        finished = stopped | (row_limits[running] <= t + 1)
        if keep_caches:
            for b in finished.nonzero().squeeze(-1).tolist():
                kept[int(running[b])] = row_cache(kv_cache, b, attention[b])
        if t + 1 == longest or bool(finished.all()):
            break
        if bool(finished.any()):
            keep = (~finished).nonzero().squeeze(-1)
            kv_cache.batch_select_indices(keep)
            running, chosen = running[keep], chosen[keep]
            attention, next_position = attention[keep], next_position[keep]
        attention = torch.cat([attention, attention.new_ones((len(running), 1))], dim=1)
        logits = _last_logits(model, chosen[:, None], attention, next_position, kv_cache, compiled)
        next_position = next_position + 1

    stop_set = set(stops.tolist())
    completions = [
        Completion(tuple(ids[:n]), tuple(lps[:n]), stopped=ids[n - 1] in stop_set)
        for ids, lps, n in zip(tokens.tolist(), logprobs.tolist(), lengths.tolist())
    ]
    if keep_caches:
        completions = [
            with_cache(c, tuple(prompts[row // num_samples]), *kept[row])
            for row, c in enumerate(completions)
        ]
    return [completions[i : i + num_samples] for i in range(0, rows, num_samples)]


def with_cache(completion: Completion, prompt: tuple[int, ...], keys, values) -> Completion:
    """`completion` carrying the cache of `prompt` and its tokens but the last."""
    token_ids = prompt + completion.token_ids[:-1]
    if keys[0].shape[1] != len(token_ids):  # the loop's bookkeeping, checked where it is cheap
        raise RuntimeError(f"a cache of {keys[0].shape[1]} tokens for {len(token_ids)}")
    return dataclasses.replace(completion, cache=RowCache(token_ids, keys, values))
