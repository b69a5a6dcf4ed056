"""Sampling completions from a causal LM with a KV cache. Side effects: forward passes of the
given model under torch.no_grad() (its weights and mode are left as they are) and draws from the
given torch.Generator.

All completions of one prompt decode together as one batch: the prompt is run once, its KV cache
is repeated for each completion, and every new token is one forward pass of the still-running
completions. The completions share the prompt, so no padding is needed; a completion that emits
eos leaves the batch (its cache rows are dropped).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: tuple[int, ...]
    """The generated tokens; the last one is eos when `stopped`."""
    logprobs: tuple[float, ...]
    """Per generated token, log-softmax(logits / temperature) at that token, computed in float32."""
    stopped: bool
    """True when the model emitted eos, False when max_new_tokens cut it off."""


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


def _last_logits(model: nn.Module, input_ids: Tensor, kv_cache) -> Tensor:
    out = model(
        input_ids=input_ids,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_keyword(type(model)): kv_cache},
    )
    return out.logits[:, -1].float()


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_token_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """`num_samples` completions of one prompt, each ending at eos or after max_new_tokens.

    Sampling draws from softmax(logits / temperature) with `generator` (on the model's device);
    `greedy` takes the most likely token instead (and draws nothing). The recorded logprobs are
    log-softmax(logits / temperature) either way. Put the model in eval mode first.
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(
            f"need num_samples >= 1 and max_new_tokens >= 1, got {num_samples}, {max_new_tokens}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    from transformers import DynamicCache

    device = next(model.parameters()).device
    kv_cache = DynamicCache(config=model.config)
    logits = _last_logits(model, torch.tensor([list(prompt_ids)], device=device), kv_cache)
    kv_cache.batch_repeat_interleave(num_samples)
    logits = logits.expand(num_samples, -1)

    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    running = torch.arange(num_samples, device=device)  # which completion each batch row is
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if greedy:
            chosen = logp.argmax(dim=-1)
        else:
            chosen = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        for row, token, lp in zip(running.tolist(), chosen.tolist(), chosen_logp.tolist()):
            tokens[row].append(token)
            logprobs[row].append(lp)
        going = chosen != eos_token_id
        if t + 1 == max_new_tokens or not bool(going.any()):
            break
        if not bool(going.all()):
            keep = going.nonzero().squeeze(-1)
            kv_cache.batch_select_indices(keep)
            running, chosen = running[keep], chosen[keep]
        logits = _last_logits(model, chosen[:, None], kv_cache)
    return [
        Completion(tuple(ids), tuple(lps), stopped=ids[-1] == eos_token_id)
        for ids, lps in zip(tokens, logprobs)
    ]
