"""The in-process rollout engine. Side effects: loads an unsharded inference copy of the model,
copies the live policy's weights into it before every rollout (a collective under FSDP2), reads
the prompts file, generates, and all-reduces the rollout metrics across ranks when distributed
(with rollout.filter_groups it also all-gathers, each round, the groups each rank still needs);
with rollout.async_level > 0 it generates in a background thread, on a copy of its own, and the
policies that thread still needs are part of the engine's state in every checkpoint (see
AsyncRollouts).

One step's rollout, on every rank at the same point of the fold:
1. sync: the policy's full state dict (gathered from its FSDP2 shards) is loaded into the copy;
2. the step's global prompts are the next prompts_per_step of the prompt order; this rank takes
   its contiguous share;
3. the rank's episodes run (fnt.rollout.environments.episodes): the first turn decodes the
   rank's prompts together, group_size completions each, sampled from the copy; each prompt's
   draws come from its own generator, seeded by (seed, step, the prompt's slot in the step), so
   a step's samples do not depend on the number of ranks and a resumed run draws exactly what
   an uninterrupted one would (fnt.rollout.sampling); with an environment that answers, each
   episode's next turn joins the decoding batch as soon as its environment has answered
   (continuous batching, fnt.rollout.continuous; `ModelStream`), or under rollout.lockstep every
   later turn is one batched decode of the episodes still running (`ModelTurns`); either way a
   later turn reads only the episode's new tokens: its KV cache is kept from turn to turn;
4. each episode is scored by the environment (single-turn: rollout.reward of its completion),
   advantages are relative within the group;
5. with rollout.filter_groups, the groups whose advantages are all zero (equal rewards) are
   replaced by the groups of the next prompts of the order, round after round
   (`InProcessEngine.filtered_sample`);
6. the samples are packed into micro-batches whose rows fit their lengths (fnt.rollout.pack),
   as many on every rank (the most any rank needs).
Generation runs on the copy, outside FSDP2, so ranks may generate different lengths without
their collectives getting out of step.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from fnt.batch import DataPosition, RLBatch
from fnt.config import ConfigError, RLConfig, check_filter_groups
from fnt.distributed.collectives import all_gather_objects, full_state_dict
from fnt.distributed.parallel import rank_bounds, rank_share
from fnt.distributed.runtime import Runtime
from fnt.model.compile import compile_layers_, compiles
from fnt.model.loading import decoder_layers, load_hf_model
from fnt.model.lora import add_adapters_, is_adapted
from fnt.rollout.base import (
    PromptRollouts,
    filter_metrics,
    has_signal,
    rollout_policy_step,
)
from fnt.rollout.continuous import ContinuousBatch, Request, recorded_logprobs, supports
from fnt.rollout.pack import RolloutSample
from fnt.rollout.prompts import step_prompts
from fnt.rollout.sampling import Completion, RowCache, generate, sampling_seed, turn_seed
from fnt.state import TrainState


def inference_copy(config: RLConfig, runtime: Runtime) -> nn.Module:
    """The engine's unsharded model to generate with: the policy's architecture (with its LoRA
    adapters, whose values each sync brings) and the base's weights, frozen. With model.compile
    its decoder layers are compiled too, and decode compiled (fnt.model.decode_cache); the
    background copy of async_level > 0 (a deepcopy, which drops compilation) decodes eagerly."""
    model = load_hf_model(config.model, runtime.device)
    if config.model.lora.rank:
        add_adapters_(model, config.model.lora)
    if compiles(config.model.compile, runtime.device.type, config.model.ac):
        compile_layers_(decoder_layers(model))
    return model.eval().requires_grad_(False)


def copy_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """What an inference copy needs of the live policy (a collective under FSDP2): its full
    state dict, or of a LoRA policy the trained weights only (the frozen base never changes)."""
    return full_state_dict(policy, trained_only=is_adapted(policy))


def load_policy_(copy: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load `copy_weights` into an inference copy (a LoRA copy keeps its base)."""
    result = copy.load_state_dict(weights, strict=not is_adapted(copy))
    if result.unexpected_keys:
        raise RuntimeError(f"the policy has weights the inference copy lacks: {result}")


class ModelTurns:
    """The in-process engine's TurnSampler (fnt.rollout.environments.episodes): each turn of
    all running episodes is one batched `generate` on the model. The first turn draws from each
    prompt's generator, seeded by (seed, step, the prompt's slot in the step), exactly as a
    single-turn rollout; a later turn draws each episode's tokens from a generator of its own,
    seeded by (seed, step, slot, episode, turn). So the samples do not depend on the number of
    ranks, on which other episodes are still running, or on whether the run was resumed.

    With `keep_caches` (an environment that may answer), each episode's KV cache is kept from
    one turn to the next, so a later turn reads only the episode's new tokens (its last sampled
    token and the environment's reply) instead of the whole episode again; the caches of the
    episodes a turn leaves out (they ended) are let go then.
    """

    def __init__(
        self, engine: "InProcessEngine", model: nn.Module, step: int, lo: int, keep_caches: bool
    ) -> None:
        self.engine, self.model, self.step, self.lo = engine, model, step, lo
        self.device = engine.runtime.device
        self.keep_caches = keep_caches
        self.caches: dict[tuple[int, int], RowCache] = {}  # (slot, episode) -> its cache

    def _generate(self, prompts, num_samples, max_new_tokens, seeds, caches=None):
        rollout = self.engine.config.rollout
        return generate(
            self.model,
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.engine.stop_token_ids,
            temperature=rollout.temperature,
            generators=[torch.Generator(device=self.device).manual_seed(s) for s in seeds],
            caches=caches,
            keep_caches=self.keep_caches,
        )

    def _keep(self, completion: Completion, slot: int, index: int) -> Completion:
        """The completion without its cache, which stays here for the episode's next turn."""
        if completion.cache is not None:
            self.caches[(slot, index)] = completion.cache
        return dataclasses.replace(completion, cache=None)

    def stream(self) -> Optional["ModelStream"]:
        """Continuous batching of the turns (rollout.lockstep = false), when the model's cache
        keeps every token and episodes may have later turns; else None (lockstep)."""
        if not (self.keep_caches and supports(self.model)):
            return None
        return ModelStream(self)

    def reusable_cache(self, slot: int, index: int, context) -> Optional[RowCache]:
        """The episode's kept cache, taken from the store, when it is of a prefix of `context`:
        an environment that rewrote the history (Reply.history) starts the episode's context
        anew, and what the cache read is no longer its beginning."""
        cache = self.caches.pop((slot, index), None)
        if cache is None or tuple(context[: len(cache.token_ids)]) != cache.token_ids:
            return None
        return cache

    def first(self, prompts, num_samples, max_new_tokens):
        seed = self.engine.config.seed
        seeds = [sampling_seed(seed, self.step, self.lo + i) for i in range(len(prompts))]
        groups = self._generate(prompts, num_samples, max_new_tokens, seeds)
        return [
            [self._keep(c, slot, index) for index, c in enumerate(group)]
            for slot, group in enumerate(groups)
        ]

    def next(self, contexts, max_new_tokens, keys):
        seed = self.engine.config.seed
        seeds = [
            turn_seed(seed, self.step, self.lo + slot, index, turn) for slot, index, turn in keys
        ]
        caches = [
            self.reusable_cache(slot, index, c) for (slot, index, _), c in zip(keys, contexts)
        ]
        self.caches = {}
        groups = self._generate(contexts, 1, list(max_new_tokens), seeds, caches)
        return [self._keep(c, slot, index) for (c,), (slot, index, _) in zip(groups, keys)]


class ModelStream:
    """The in-process engine's TurnStream (fnt.rollout.environments.episodes): the turns of a
    step's episodes decode in one continuous batch (fnt.rollout.continuous), which a turn joins
    as soon as it is asked for. The generators are ModelTurns' (a first turn draws from its
    prompt's, a later one from its own), and so are the kept caches."""

    def __init__(self, turns: ModelTurns) -> None:
        self.turns = turns
        rollout = turns.engine.config.rollout
        self.batch = ContinuousBatch(
            turns.model,
            stop_token_ids=turns.engine.stop_token_ids,
            temperature=rollout.temperature,
            keep_caches=True,
        )
        self.deliver = None

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.turns.device).manual_seed(seed)

    def start(self, prompts, num_samples, max_new_tokens, deliver) -> None:
        turns, seed = self.turns, self.turns.engine.config.seed
        self.deliver = deliver
        for slot, ids in enumerate(prompts):
            keys = tuple((slot, index, 1) for index in range(num_samples))
            generator = self._generator(sampling_seed(seed, turns.step, turns.lo + slot))
            self.batch.add(Request(keys, tuple(ids), max_new_tokens, generator))

    def submit(self, context, max_new_tokens, key) -> None:
        turns, (slot, index, turn) = self.turns, key
        seed = turn_seed(turns.engine.config.seed, turns.step, turns.lo + slot, index, turn)
        cache = turns.reusable_cache(slot, index, context)
        self.batch.add(
            Request((key,), tuple(context), max_new_tokens, self._generator(seed), cache)
        )

    def work(self) -> bool:
        if not self.batch.busy:
            return False
        for (slot, index, turn), completion in self.batch.step():
            self.deliver((slot, index, turn), self.turns._keep(completion, slot, index))
        return True

    def end(self, slot: int, index: int) -> None:
        self.turns.caches.pop((slot, index), None)  # its KV cache, freed while others run

    def settle_(self, episodes) -> None:
        """Each episode's recorded logprobs from forward passes of the finished episodes
        (fnt.rollout.continuous.recorded_logprobs): which turns shared a decoding batch depends
        on timing, and the last float bits of their logprobs with it."""
        temperature = self.turns.engine.config.rollout.temperature
        flat = [e for group in episodes for e in group]
        branches = [e.branches() for e in flat]
        sequences = [(b.token_ids, b.sampled) for bs in branches for b in bs]
        recorded = iter(recorded_logprobs(self.turns.model, sequences, temperature))
        for episode, own in zip(flat, branches):
            settled = []
            for branch in own:
                logprobs, values = list(branch.logprobs), iter(next(recorded))
                for i, sampled in enumerate(branch.sampled):
                    if sampled:
                        logprobs[i] = next(values)
                settled.append(dataclasses.replace(branch, logprobs=tuple(logprobs)))
            episode.closed = settled[:-1]
            episode.logprobs = list(settled[-1].logprobs)


class InProcessEngine(PromptRollouts):
    """Generates each step's rollouts with an unsharded inference copy of the policy.

    Built once per run (it reads the tokenizer, the prompts and the reward, and loads the copy,
    so setup errors surface before the first step); `rollout(state)` then makes the rollouts of
    update state.progress.step + 1 from the weights `state` holds.
    """

    def __init__(self, config: RLConfig, runtime: Runtime) -> None:
        super().__init__(config, runtime)
        check_filter_groups(config.rollout)
        self.model = inference_copy(config, runtime)
        self.background = AsyncRollouts(self) if config.rollout.async_level > 0 else None

    def sync_weights_(self, policy: nn.Module) -> None:
        """Load the live policy's weights into the copy; every rank calls it at the same point."""
        load_policy_(self.model, copy_weights(policy))

    def rollout(self, state: TrainState) -> RLBatch:
        """This rank's RL batch for update state.progress.step + 1.

        async_level 0: sampled from the policy's weights as `state` has them (the copy is synced
        first; a collective under FSDP2). async_level k > 0: sampled from the policy after step
        max(0, step - 1 - k), in the background (see `AsyncRollouts`).
        """
        if self.background is not None:
            return self.background.rollout(state)
        step, position = state.progress.step + 1, state.progress.data
        self.order.check(position)
        started = time.perf_counter()
        self.sync_weights_(state.handles.model)
        if self.config.rollout.filter_groups:
            samples, dropped, after, counts = self.filtered_sample(
                self.model, step, position, state.progress.step
            )
            seconds = time.perf_counter() - started
            return self.batch(
                samples, after, seconds, step=step, dropped=dropped, extra_metrics=counts
            )
        samples, dropped, after = self.sample(self.model, step, position, state.progress.step)
        return self.batch(samples, after, time.perf_counter() - started, step=step, dropped=dropped)

    def sample(
        self, model: nn.Module, step: int, position: DataPosition, policy_step: int
    ) -> tuple[list[RolloutSample], int, DataPosition]:
        """This rank's scored samples of update `step` from `model` (the policy after
        `policy_step`), the truncated episodes dropped, and the prompt position after the step.
        No collective, so it may run in a background thread."""
        runtime = self.runtime
        dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
        prompt_ids, after = self.step_prompts(position)
        lo, _ = rank_bounds(len(prompt_ids), dp_rank, dp_size, what="prompts per step")
        prompts = [
            self.prompts[i]
            for i in rank_share(prompt_ids, dp_rank, dp_size, what="prompts per step")
        ]
        turns = ModelTurns(self, model, step, lo, keep_caches=self.multi_turn)
        samples, dropped = self.episodes(prompts, turns, policy_step)
        return samples, dropped, after

    def filtered_sample(
        self, model: nn.Module, step: int, position: DataPosition, policy_step: int
    ) -> tuple[list[RolloutSample], int, DataPosition, dict[str, float]]:
        """`sample` with rollout.filter_groups (DAPO's dynamic sampling): this rank's groups
        with a signal (`has_signal`), the truncated episodes dropped, the position after the
        last prompt drawn, and the step's `filter_metrics`. One all-gather per round.

        Round 1 draws the step's prompts_per_step prompts exactly as `sample` does. Each later
        round draws, from where the one before stopped, as many prompts as the ranks together
        still need (rank r takes the r-th contiguous share, of the size it needs), and every
        prompt's draws are seeded by its slot among all the prompts the step drew
        (fnt.rollout.sampling), so which prompts a step draws and what they sample depend on
        (seed, step, position) only: not on the number of ranks, nor on a resume. The last
        round (rollout.filter_max_rounds) keeps all its groups, so the batch always has
        prompts_per_step groups; those without signal are counted, and train with zero
        advantages as they would unfiltered.
        """
        rollout, runtime = self.config.rollout, self.runtime
        dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
        needs = [rollout.prompts_per_step // dp_size] * dp_size  # groups each rank still needs
        samples: list[RolloutSample] = []
        drawn = dropped = filtered = exhausted = rounds = 0
        while sum(needs):
            rounds += 1
            last = rounds == rollout.filter_max_rounds
            prompt_ids, position = step_prompts(self.order, position, sum(needs))
            lo = sum(needs[:dp_rank])
            mine = prompt_ids[lo : lo + needs[dp_rank]]
            groups: list[list[RolloutSample]] = []
            if mine:
                turns = ModelTurns(self, model, step, drawn + lo, keep_caches=self.multi_turn)
                groups, round_dropped = self.episode_groups(
                    [self.prompts[i] for i in mine], turns, policy_step
                )
                dropped += round_dropped
            kept = groups if last else [g for g in groups if has_signal(g)]
            samples += [sample for group in kept for sample in group]
            without_signal = sum(not has_signal(g) for g in groups)
            drawn += len(prompt_ids)
            # Every rank learns what every rank still needs: the next round's shares.
            gathered = all_gather_objects(
                (needs[dp_rank] - len(kept), without_signal), runtime.distributed
            )
            needs = [need for need, _ in gathered]
            if last:
                exhausted = sum(count for _, count in gathered)
            else:
                filtered += sum(count for _, count in gathered)
        return samples, dropped, position, filter_metrics(rounds, filtered, exhausted)

    def state_dict(self) -> dict[str, Any]:
        """The policies the background jobs of a resumed run need (async_level > 0), else {}."""
        return {} if self.background is None else self.background.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.background is not None:
            self.background.load_state_dict(state)

    def close(self) -> None:
        """Stop the background generation, if any: pending jobs are cancelled, a running one is
        waited for."""
        if self.background is not None:
            self.background.close()


class AsyncRollouts:
    """Rollouts generated ahead in a background thread: rollout.async_level = k > 0.

    The rollouts of update n come from the policy after step p(n) = max(0, n - 1 - k), always
    exactly that one, so they do not depend on timing. When the trainer asks for update n (its
    state holds the policy after step n - 1), the jobs of updates n .. min(n + k, max_steps) are
    in flight or queued: update n + k is the one that needs the weights just reached, which are
    copied (a collective under FSDP2, so in the calling thread) and handed to its job. One
    worker thread runs the jobs in order on an inference model of its own (the engine's copy
    stays free for validation's greedy answers), loading each job's weights first; it samples
    and scores only, and the packing and the metric collectives run in the calling thread, so no
    collective ever runs off the main thread.

    Exact resume: the copies of the policies a resumed run's first jobs need (after steps
    m - k .. m - 1 for a checkpoint at m; the policy after m is the checkpoint's model) are the
    engine's `state_dict`, which the driver saves in the checkpoint's transaction.
    """

    def __init__(self, engine: InProcessEngine) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        self.k = engine.config.rollout.async_level
        self.model = copy.deepcopy(engine.model)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fnt-rollout")
        self.jobs: dict[tuple[int, DataPosition], Any] = {}
        # The copied policies, by step, that queued jobs or a resumed run may still need, and the
        # oldest of them a checkpoint must hold.
        self.policies: dict[int, dict[str, torch.Tensor]] = {}
        self.saved_from = 0

    def rollout(self, state: TrainState) -> RLBatch:
        engine, k = self.engine, self.k
        step, position = state.progress.step + 1, state.progress.data
        engine.order.check(position)
        started = time.perf_counter()
        wanted = engine.jobs_ahead(self.jobs, step, position, k)
        for j, at in wanted:
            if (j, at) in self.jobs:
                continue
            policy_step = rollout_policy_step(j, k)
            if policy_step == state.progress.step and policy_step not in self.policies:
                self.policies[policy_step] = {
                    n: t.detach().clone() for n, t in copy_weights(state.handles.model).items()
                }
            self.jobs[(j, at)] = self.pool.submit(self.job, self.policy(policy_step), j, at)
        # The wanted jobs' policies stay (asking again for this update submits its job again);
        # the checkpoint after this update holds the ones from step - k on.
        self.policies = {p: w for p, w in self.policies.items() if p >= step - 1 - k}
        self.saved_from = step - k
        samples, dropped, after, generation_seconds = self.jobs[wanted[0]].result()
        return engine.batch(
            samples,
            after,
            time.perf_counter() - started,
            step=step,
            generation_seconds=generation_seconds,
            staleness=state.progress.step - rollout_policy_step(step, k),
            dropped=dropped,
        )

    def policy(self, policy_step: int) -> dict[str, torch.Tensor]:
        if policy_step not in self.policies:
            raise ConfigError(
                f"rollout.async_level = {self.k}: the next rollouts come from the policy after "
                f"step {policy_step}, which the checkpoint this run resumed from does not hold "
                "(it was written with another async_level, or by an older fnt); resume with the "
                "async_level it was written with, or from a checkpoint that has it"
            )
        return self.policies[policy_step]

    def job(self, weights: dict[str, torch.Tensor], step: int, position: DataPosition):
        started = time.perf_counter()
        load_policy_(self.model, weights)
        samples, dropped, after = self.engine.sample(
            self.model, step, position, rollout_policy_step(step, self.k)
        )
        return samples, dropped, after, time.perf_counter() - started

    def state_dict(self) -> dict[str, Any]:
        return {"policies": {p: w for p, w in self.policies.items() if p >= self.saved_from}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policies = dict(state.get("policies", {}))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.jobs.clear()
