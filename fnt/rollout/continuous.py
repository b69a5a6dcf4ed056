"""Continuous batching: many sequences decode together, and a new one joins the batch as soon as
it is asked for, without waiting for the others to finish. Side effects: forward passes of the
given model under torch.no_grad() (its weights and mode are left as they are) and draws from the
requests' torch.Generators.

The in-process engine runs the episodes of a step with it (rollout.lockstep = false,
fnt.rollout.environments.episodes): an episode whose environment has answered asks for its
next turn, and that turn decodes beside the other episodes' turns from the next token on.

Every `step` is one forward pass and one sampled token per row. A row's last sampled token is
read by the next step's forward pass, so between steps every row has a token the model has not
read. When requests are waiting, that forward pass also reads them: the batch is rebuilt from
each running row's KV cache (its real tokens, the padding taken out) and each new request's
(`RowCache`, a Completion's cache from an earlier call, or none), all left-padded to the longest
(fnt.rollout.sampling.cached_prefix), with each row's unread tokens after it; a request of n
samples is read once and its rows repeated n times. Otherwise the forward pass reads the one
token of every row. A row that stops (a stop token, or its max_new_tokens) leaves the batch as
a Completion, with its cache when the batch keeps caches.

Sampling is what fnt.rollout.sampling.generate does, row by row: the rows of one request draw
from its generator, in one call, the exponential race's noise of those of them still running,
so a request's tokens do not depend on what else is in the batch, up to the last float bits in
which a padded batched forward may differ from another. Only models whose caches keep every
token can be batched so (`supports`): a sliding-window layer drops old tokens, and its rows
cannot be cut out of the batch.

Which rows share a forward pass depends on when requests arrive, and so on time (an
environment's latency), and those last float bits with it. What a run records must not: the
engine records each episode's logprobs from one forward pass of the episode alone
(`logprobs_alone`), the same whatever was batched beside it, so a resumed run trains on exactly
the numbers the uninterrupted one did (the sampled tokens could differ only where two candidates
tie to those last bits).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from fnt.model.attention import decoding_attention
from fnt.model.compile import eager_layers
from fnt.rollout.sampling import (
    Completion,
    RowCache,
    _last_logits,
    cached_prefix,
    keeps_every_token,
    left_padded,
    row_cache,
)


@dataclass(frozen=True)
class Request:
    """Sequences to sample: `len(keys)` completions of `context`, at most `max_new_tokens`
    each, drawn from `generator`, after the tokens `cache` holds (a prefix of the context)."""

    keys: tuple[Hashable, ...]
    context: tuple[int, ...]
    max_new_tokens: int
    generator: Optional[torch.Generator] = None
    cache: Optional[RowCache] = None


@dataclass
class _Row:
    key: Hashable
    context: tuple[int, ...]
    limit: int
    generator: int  # the index of its request's generator in ContinuousBatch.generators
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def supports(model: nn.Module) -> bool:
    """Whether the model's KV cache keeps every token, so that rows can join and leave."""
    from transformers import DynamicCache

    return keeps_every_token(DynamicCache(config=model.config))


class ContinuousBatch:
    """Rows that decode together; `add` queues a request, `step` decodes one token of every row
    and returns the completions that finished (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        stop_token_ids: Collection[int],
        temperature: float = 1.0,
        keep_caches: bool = False,
    ) -> None:
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation needs a token to stop at")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not supports(model):
            raise ValueError("the model's cache drops tokens (sliding window): rows cannot join")
        self.model, self.temperature, self.keep_caches = model, temperature, keep_caches
        self.device = next(model.parameters()).device
        self.stops = torch.tensor(sorted(stop_token_ids), dtype=torch.int64, device=self.device)
        self.stop_set = frozenset(int(t) for t in stop_token_ids)
        self.waiting: list[Request] = []
        self.rows: list[_Row] = []
        self.generators: list[Optional[torch.Generator]] = []
        self.kv_cache = None
        self.attention: Optional[Tensor] = None  # [R, W] 1 on the tokens each row has read
        self.next_position: Optional[Tensor] = None  # [R, 1] the position of each unread token

    @property
    def busy(self) -> bool:
        """Whether a row is decoding or a request waits."""
        return bool(self.rows or self.waiting)

    def add(self, request: Request) -> None:
        """Queue `request`; the next `step` reads it. ValueError when it is malformed."""
        cache = request.cache
        if not request.keys or not request.context or request.max_new_tokens < 1:
            raise ValueError(
                f"a request needs keys, a context and max_new_tokens >= 1, got {len(request.keys)}"
                f" keys, {len(request.context)} tokens, {request.max_new_tokens}"
            )
        if cache is not None and (
            len(cache.token_ids) >= len(request.context)
            or tuple(request.context[: len(cache.token_ids)]) != cache.token_ids
        ):
            raise ValueError(f"the cache of {request.keys[0]!r} is not of a proper prefix of it")
        self.waiting.append(request)

    @torch.no_grad()
    def step(self) -> list[tuple[Hashable, Completion]]:
        """One forward pass and one token of every row; the rows that finished, as (key,
        completion), in row order. Nothing when no row decodes and no request waits."""
        if self.waiting:
            logits = self._read_waiting()
        elif self.rows:
            logits = self._read_last_tokens()
        else:
            return []
        logp = torch.log_softmax(logits / self.temperature, dim=-1)
        chosen = self._race(logp)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        finished, kept = [], []
        for b, (row, token, lp) in enumerate(zip(self.rows, chosen.tolist(), chosen_logp.tolist())):
            row.tokens.append(token)
            row.logprobs.append(lp)
            if token in self.stop_set or len(row.tokens) >= row.limit:
                finished.append((row.key, self._completion(b, row)))
            else:
                kept.append(b)
        self._keep_rows(kept)
        return finished

    def _completion(self, b: int, row: _Row) -> Completion:
        stopped = row.tokens[-1] in self.stop_set
        completion = Completion(tuple(row.tokens), tuple(row.logprobs), stopped=stopped)
        if not self.keep_caches:
            return completion
        keys, values = row_cache(self.kv_cache, b, self.attention[b])
        token_ids = row.context + tuple(row.tokens[:-1])
        if keys[0].shape[1] != len(token_ids):  # the bookkeeping, checked where it is cheap
            raise RuntimeError(f"a cache of {keys[0].shape[1]} tokens for {len(token_ids)}")
        return Completion(
            completion.token_ids,
            completion.logprobs,
            stopped=stopped,
            cache=RowCache(token_ids, keys, values),
        )

    def _keep_rows(self, kept: list[int]) -> None:
        if len(kept) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in kept]
        if not self.rows:
            self.kv_cache = self.attention = self.next_position = None
            self.generators = []
            return
        index = torch.tensor(kept, dtype=torch.int64, device=self.device)
        self.kv_cache.batch_select_indices(index)
        self.attention, self.next_position = self.attention[index], self.next_position[index]

    def _race(self, logp: Tensor) -> Tensor:
        """One token per row: argmax(p / q), q ~ Exp(1), each request's rows drawing their q
        from its generator in one call (fnt.rollout.sampling.exponential_race)."""
        noise = torch.empty_like(logp)
        by_generator: dict[int, list[int]] = {}
        for b, row in enumerate(self.rows):
            by_generator.setdefault(row.generator, []).append(b)
        for g, rows in by_generator.items():
            draws = torch.empty(
                (len(rows), logp.shape[-1]), dtype=logp.dtype, device=logp.device
            ).exponential_(1.0, generator=self.generators[g])
            noise[torch.tensor(rows, device=logp.device)] = draws
        return (logp.exp() / noise).argmax(dim=-1)

    def _read_last_tokens(self) -> Tensor:
        """The forward pass of every row's last sampled token."""
        last = torch.tensor([[row.tokens[-1]] for row in self.rows], device=self.device)
        self.attention = torch.cat(
            [self.attention, self.attention.new_ones((len(self.rows), 1))], dim=1
        )
        logits = _last_logits(self.model, last, self.attention, self.next_position, self.kv_cache)
        self.next_position = self.next_position + 1
        return logits

    def _read_waiting(self) -> Tensor:
        """The forward pass that rebuilds the batch: the running rows (their caches and last
        tokens) and then the waiting requests, each read once and repeated per sample."""
        caches: list[Optional[RowCache]] = []
        news: list[Sequence[int]] = []
        for b, row in enumerate(self.rows):
            keys, values = row_cache(self.kv_cache, b, self.attention[b])
            caches.append(RowCache(row.context + tuple(row.tokens[:-1]), keys, values))
            news.append([row.tokens[-1]])
        repeats = [1] * len(self.rows)
        generators = {id(g): i for i, g in enumerate(self.generators)}
        for request in self.waiting:
            caches.append(request.cache)
            news.append(
                request.context[0 if request.cache is None else len(request.cache.token_ids) :]
            )
            repeats.append(len(request.keys))
            if id(request.generator) not in generators:
                generators[id(request.generator)] = len(self.generators)
                self.generators.append(request.generator)
            g = generators[id(request.generator)]
            self.rows += [
                _Row(key, request.context, request.max_new_tokens, g) for key in request.keys
            ]
        self.waiting = []
        pad_id = int(self.stops[0])  # hidden by the attention mask, so any valid id will do
        ids, attention, positions = left_padded(news, pad_id, self.device)
        if any(c is not None for c in caches):
            kv_cache, cached, starts = cached_prefix(caches, self.model.config, self.device)
            positions = positions + starts[:, None]
            attention = torch.cat([cached, attention], dim=1)
        else:
            from transformers import DynamicCache

            kv_cache = DynamicCache(config=self.model.config)
        logits = _last_logits(self.model, ids, attention, positions, kv_cache)
        index = torch.repeat_interleave(
            torch.arange(len(repeats), device=self.device),
            torch.tensor(repeats, device=self.device),
        )
        kv_cache.batch_select_indices(index)
        self.kv_cache = kv_cache
        self.attention = attention[index]
        self.next_position = positions[index, -1:] + 1
        return logits[index]


@torch.no_grad()
def logprobs_alone(
    model: nn.Module, token_ids: Sequence[int], positions: Sequence[int], temperature: float
) -> list[float]:
    """log-softmax(logits / temperature) of the tokens at `positions` (each > 0) of
    `token_ids`, in float32, from one forward pass of the sequence alone (module docstring)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=device)
    before = torch.tensor([p - 1 for p in positions], dtype=torch.int64, device=device)
    with eager_layers(), decoding_attention(model):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=before).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, before + 1][:, None]).squeeze(-1).tolist()
