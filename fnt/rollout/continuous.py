"""Continuous batching: many sequences decode together, and a new one joins the batch as soon as
it is asked for, without waiting for the others to finish. Side effects: forward passes of the
given model under torch.no_grad() (its weights and mode are left as they are) and draws from the
requests' torch.Generators.

The in-process engine runs the episodes of a step with it (rollout.lockstep = false,
fnt.rollout.environments.episodes): an episode whose environment has answered asks for its
next turn, and that turn decodes beside the other episodes' turns from the next token on.

Every `step` samples one token per row. A row's last sampled token is read by the next step's
forward pass, so between steps every row has a token the model has not read: a step's first
forward pass reads the one token of every running row. When requests are waiting, a second
forward pass reads them alone (each after its `RowCache`, a Completion's cache from an earlier
call, or from its start; left-padded to the longest, fnt.rollout.sampling.cached_prefix; a
request of n samples is read once and its rows repeated n times), and their KV caches join the
batch's, both left-padded to the wider (the running rows are not read again). A row that stops
(a stop token, or its max_new_tokens) leaves the batch as a Completion, with its cache when the
batch keeps caches.

Sampling is what fnt.rollout.sampling.generate does, row by row: the rows of one request draw
from its generator, in one call, the exponential race's noise of those of them still running,
so a request's tokens do not depend on what else is in the batch, up to the last float bits in
which a padded batched forward may differ from another. Only models whose caches keep every
token can be batched so (`supports`): a sliding-window layer drops old tokens, and its rows
cannot be cut out of the batch.

Which rows share a forward pass depends on when requests arrive, and so on time (an
environment's latency), and those last float bits with it. What a run records must not: the
engine records the logprobs of a step's episodes from forward passes made after the last turn
(`recorded_logprobs`), in batches that the episodes alone decide (in their order, up to a token
budget), never the timing, so a resumed run trains on exactly the numbers the uninterrupted one
did (the sampled tokens could differ only where two candidates tie to those last bits).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
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
        """One token of every row (module docstring); the rows that finished, as (key,
        completion), in row order. Nothing when no row decodes and no request waits."""
        parts = []
        if self.rows:
            parts.append(self._read_last_tokens())
        if self.waiting:
            parts.append(self._read_waiting())
        if not parts:
            return []
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
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
        """The forward pass of the waiting requests alone, each read once and repeated per
        sample; their rows join the batch after the running ones (`_join`)."""
        caches = [request.cache for request in self.waiting]
        news = [r.context[0 if r.cache is None else len(r.cache.token_ids) :] for r in self.waiting]
        repeats = [len(request.keys) for request in self.waiting]
        generators = {id(g): i for i, g in enumerate(self.generators)}
        for request in self.waiting:
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
        self._join(kv_cache, attention[index], positions[index, -1:] + 1)
        return logits[index]

    def _join(self, kv_cache, attention: Tensor, next_position: Tensor) -> None:
        """The new rows' cache, attention mask and next positions after the running rows':
        both sides left-padded to the wider, then the columns no row attends to cut off."""
        if self.kv_cache is None:
            self.kv_cache, self.attention, self.next_position = kv_cache, attention, next_position
            return
        from transformers import DynamicCache

        width = max(self.attention.shape[1], attention.shape[1])

        def padded(t: Tensor) -> Tensor:  # [B, W] masks or [B, heads, W, dim] keys and values
            missing = width - (t.shape[1] if t.dim() == 2 else t.shape[2])
            return F.pad(t, (missing, 0) if t.dim() == 2 else (0, 0, missing, 0))

        both = torch.cat([padded(self.attention), padded(attention)])
        start = int(both.any(dim=0).int().argmax())  # the first column a row attends to
        joined = DynamicCache(config=self.model.config)
        for i, (old, new) in enumerate(zip(self.kv_cache.layers, kv_cache.layers)):
            keys = torch.cat([padded(old.keys), padded(new.keys)])[:, :, start:]
            values = torch.cat([padded(old.values), padded(new.values)])[:, :, start:]
            joined.update(keys, values, i)
        self.kv_cache, self.attention = joined, both[:, start:]
        self.next_position = torch.cat([self.next_position, next_position])


RECORDING_TOKENS = 16384
"""Tokens (sequences x the longest of them) that `recorded_logprobs` reads in one forward pass."""


@torch.no_grad()
def recorded_logprobs(
    model: nn.Module,
    sequences: Sequence[tuple[Sequence[int], Sequence[bool]]],
    temperature: float,
    chunk: int = 1024,
) -> list[list[float]]:
    """Per (token ids, sampled) sequence, log-softmax(logits / temperature) in float32 of each
    sampled token (none may be the first), in order. The sequences are read in consecutive
    batches of at most RECORDING_TOKENS padded tokens, right-padded, and the LM head is
    computed at the sampled positions only, `chunk` at a time (fnt.model.lm_head)."""
    from fnt.model.lm_head import LossTokens, chunked_head, logprobs_of

    device = next(model.parameters()).device
    out: list[list[float]] = []
    start = 0
    while start < len(sequences):
        end, longest = start, 0
        while end < len(sequences):
            longest_with = max(longest, len(sequences[end][0]))
            if end > start and (end + 1 - start) * longest_with > RECORDING_TOKENS:
                break
            end, longest = end + 1, longest_with
        batch = sequences[start:end]
        ids = torch.zeros((len(batch), longest), dtype=torch.int64)
        sampled = torch.zeros((len(batch), longest), dtype=torch.bool)
        for row, (token_ids, mask) in enumerate(batch):
            if len(mask) != len(token_ids):
                raise ValueError(f"{len(mask)} sampled flags for {len(token_ids)} tokens")
            ids[row, : len(token_ids)] = torch.tensor(list(token_ids), dtype=torch.int64)
            sampled[row, : len(mask)] = torch.tensor(list(mask), dtype=torch.bool)
        if sampled[:, 0].any():
            raise ValueError("a sequence's first token cannot be sampled: nothing predicts it")
        attention = (
            torch.arange(longest)[None, :] < torch.tensor([len(t) for t, _ in batch])[:, None]
        )
        predicting = sampled[:, 1:]
        index = predicting.flatten().nonzero().squeeze(-1)
        rows, cols = index // (longest - 1), index % (longest - 1)
        tokens = LossTokens(
            mask=predicting.to(device),
            index=(rows * longest + cols).to(device),
            targets=ids[rows, cols + 1].to(device),
            temperatures=None
            if temperature == 1.0
            else torch.full((len(index),), temperature, dtype=torch.float32, device=device),
            entropy=False,
        )
        with eager_layers(model), decoding_attention(model), chunked_head(model, tokens, chunk):
            stats = model(
                input_ids=ids.to(device),
                attention_mask=attention.long().to(device),
                use_cache=False,
            ).logits
        logp = logprobs_of(stats, tokens).logp.tolist()
        counts = predicting.sum(dim=1).tolist()
        for n in counts:
            out.append(logp[:n])
            logp = logp[n:]
        start = end
    return out
