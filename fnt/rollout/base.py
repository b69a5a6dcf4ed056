"""What the rollout engines share. Side effects: `PromptRollouts` reads the tokenizer, the
model's generation_config.json and the prompts (rollout.prompts, or an environment's own), and
imports the reward or environment a "module:function" names (fnt.rollout.environments); its
`episodes` run what the sampler and the environment do; its `batch` saves the step's samples on a
sample step ({output_dir}/samples/step_N.jsonl, rank 0, after an all-gather:
fnt.rollout.saved_samples) and all-reduces the micro-batch count; `rollout_metrics` all-reduces
across ranks. The rest is pure.

The engines that sample rollout.prompts (in-process and vLLM) share PromptRollouts: the prompts,
their order, the reward, which prompts a step takes, scoring and packing a rank's samples.
Every engine shares the rules for the sampler's logprobs (`as_float32`, `LOGPROB_SLACK`) and
the reward metrics.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from fnt.batch import DataPosition, RLBatch, RLMicroBatch
from fnt.config import ConfigError, RLConfig, RolloutConfig, validate_rollout
from fnt.config.environments import supplies_prompts
from fnt.distributed.collectives import all_gather_objects, all_reduce_max, all_reduce_sum
from fnt.distributed.parallel import check_batch_layout
from fnt.distributed.runtime import Runtime
from fnt.errors import DataError
from fnt.model.tokenizer import load_tokenizer, pad_token_id, stop_token_ids
from fnt.rollout.environments import SingleTurnEnvironment, environment_of
from fnt.rollout.environments.episodes import (
    EpisodeRules,
    TurnSampler,
    require_turn_scores,
    run_episodes,
    scored_samples,
)
from fnt.rollout.environments.mixture import MixtureEnvironment, member_name
from fnt.rollout.environments.parsers import turn_parser
from fnt.rollout.pack import RolloutSample, micro_batch_count, pack_rollouts
from fnt.rollout.prompts import (
    Prompt,
    load_prompts,
    prompt_order,
    source_prompts,
    step_prompts,
)
from fnt.rollout.saved_samples import save_samples_

# A sampler's float32 or bf16 log-softmax can round a probability of 1 to a logprob a little
# above 0; anything beyond that is not a log-probability.
LOGPROB_SLACK = 1e-4


def as_float32(value: float) -> float:
    """`value` as the float32 the micro-batches store it in: +-inf beyond float32's range."""
    return ctypes.c_float(value).value


class PromptRollouts:
    """What every engine that samples rollouts from rollout.prompts shares (the in-process and
    vLLM engines): the tokenizer, stop tokens, prompts, their order and the reward, all read once
    so that setup errors surface before the first step; which prompts a step takes; and packing
    a rank's scored samples into its RLBatch."""

    def __init__(self, config: RLConfig, runtime: Runtime) -> None:
        rollout = config.rollout
        dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
        validate_rollout(rollout, dp_size=dp_size)
        check_batch_layout(
            config.batch_size, config.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
        self.config, self.runtime = config, runtime
        self.environment, name = environment_of(rollout)
        self.tokenizer = load_tokenizer(config.model.name)
        self.pad_token_id = pad_token_id(self.tokenizer)
        # eos, generation_config.json's eos list and the template's end-of-turn token.
        try:
            self.stop_token_ids = stop_token_ids(self.tokenizer, config.model.name)
        except ValueError as e:
            raise ValueError(f"{config.model.name}: nothing to stop generation at: {e}") from e
        if rollout.max_episode_tokens > config.seq_len:
            raise ConfigError(
                f"'rollout.max_episode_tokens' = {rollout.max_episode_tokens}: an episode is one "
                f"sample, so it must fit seq_len = {config.seq_len}"
            )
        budget = rollout.max_episode_tokens or config.seq_len
        self.prompts, sizes, weights, where = run_prompts(
            rollout, self.environment, name, self.tokenizer
        )
        check_prompt_lengths(
            self.prompts,
            where,
            max_new_tokens=rollout.max_new_tokens,
            seq_len=config.seq_len,
            budget=budget,
        )
        self.order = prompt_order(len(self.prompts), config.seed, sizes, weights)
        self.rules = EpisodeRules(
            group_size=rollout.group_size,
            max_new_tokens=rollout.max_new_tokens,
            max_turns=rollout.max_turns,
            max_episode_tokens=budget,
            on_truncated=rollout.on_truncated,
            on_bad_reward=rollout.on_bad_reward,
            std_normalize=rollout.std_normalize,
            prompts_path=where,
            name=name,
            reward_name=rollout.environment or rollout.reward or name,
            turn_parser=turn_parser(
                self.tokenizer.chat_template, rollout.tool_parser, rollout.reasoning_parser
            ),
            credit=rollout.credit,
            turn_discount=rollout.turn_discount,
            lockstep=rollout.lockstep,
            env_concurrency=rollout.env_concurrency,
        )
        require_turn_scores(self.environment, self.rules)
        # Whether an episode may have a later turn (engines keep what continues it, if so, and
        # run episodes on their own); a mixture's when any member's may.
        environments = (
            self.environment.members.values()
            if isinstance(self.environment, MixtureEnvironment)
            else [self.environment]
        )
        self.multi_turn = rollout.max_turns > 1 and not all(
            isinstance(e, SingleTurnEnvironment) for e in environments
        )

    def step_prompts(self, position: DataPosition) -> tuple[list[int], DataPosition]:
        """The indices of the global prompts of the step at `position`, and the position after."""
        return step_prompts(self.order, position, self.config.rollout.prompts_per_step)

    def jobs_ahead(
        self, jobs: dict, step: int, position: DataPosition, k: int
    ) -> list[tuple[int, DataPosition]]:
        """The (update, data position) keys of updates step .. step + k (not past max_steps),
        each at the position the one before leaves. Queued jobs off this chain (a state the
        queue did not expect: another step or position) are cancelled and dropped from `jobs`."""
        wanted = []
        for j in range(step, max(step, min(step + k, self.config.max_steps)) + 1):
            wanted.append((j, position))
            _, position = self.step_prompts(position)
        for key in [key for key in jobs if key not in wanted]:
            jobs.pop(key).cancel()
        return wanted

    def episodes(
        self, prompts: Sequence[Prompt], sampler: TurnSampler, policy_step: Optional[int] = None
    ) -> tuple[list[RolloutSample], int]:
        """The episodes of `prompts` (group_size each) run with `sampler` and scored, as samples
        in prompt order, and how many truncated episodes were dropped (rollout.on_truncated)."""
        if isinstance(self.environment, MixtureEnvironment):  # its samples name their member
            groups, dropped = self.episode_groups(prompts, sampler, policy_step)
            return [sample for group in groups for sample in group], dropped
        episodes = run_episodes(prompts, sampler, self.environment, self.tokenizer, self.rules)
        return scored_samples(episodes, self.environment, self.rules, policy_step)

    def episode_groups(
        self, prompts: Sequence[Prompt], sampler: TurnSampler, policy_step: Optional[int] = None
    ) -> tuple[list[list[RolloutSample]], int]:
        """`episodes`, kept apart by prompt: one list of samples per prompt (empty when all its
        episodes were dropped), and how many truncated episodes were dropped."""
        episodes = run_episodes(prompts, sampler, self.environment, self.tokenizer, self.rules)
        groups, dropped = [], 0
        for prompt, group in zip(prompts, episodes):
            # Scoring is per group, so scoring each alone gives exactly what `episodes` gives.
            samples, group_dropped = scored_samples(
                [group], self.environment, self.rules, policy_step
            )
            if isinstance(self.environment, MixtureEnvironment):
                name = member_name(prompt.record)
                samples = [replace(sample, environment=name) for sample in samples]
            groups.append(samples)
            dropped += group_dropped
        return groups, dropped

    def batch(
        self,
        samples: list[RolloutSample],
        after: DataPosition,
        seconds: float,
        *,
        step: int,
        generation_seconds: Optional[float] = None,
        staleness: int = 0,
        dropped: int = 0,
        extra_metrics: Optional[Mapping[str, float]] = None,
    ) -> RLBatch:
        """Pack this rank's samples of update `step` and measure them, and on a sample step
        save every rank's as text (fnt.rollout.saved_samples): collectives when distributed.
        `extra_metrics` (the same on every rank) join the batch's metrics."""
        config, runtime = self.config, self.runtime
        count = int(all_reduce_max([share_micro_batch_count(samples, config)], runtime)[0])
        micro_batches = save_and_pack_(
            samples,
            step,
            config,
            runtime,
            self.tokenizer,
            temperature=config.rollout.temperature,
            pad_token_id=self.pad_token_id,
            num_micro_batches=count,
        )
        metrics = rollout_metrics(
            samples, seconds, runtime, generation_seconds=generation_seconds, dropped=dropped
        )
        metrics["rollout/staleness"] = float(staleness)
        if isinstance(self.environment, MixtureEnvironment):
            metrics.update(mixture_metrics(samples, self.environment.names, runtime))
        metrics.update(extra_metrics or {})
        return RLBatch(
            micro_batches=micro_batches,
            num_samples=len(samples),
            data_after=after,
            metrics=metrics,
        )


def share_micro_batch_count(samples: Sequence[RolloutSample], config: RLConfig) -> int:
    """How many micro-batches a rank's share of a step's samples packs into. Pure."""
    return micro_batch_count(
        [s.length for s in samples],
        seq_len=config.seq_len,
        micro_batch_size=config.micro_batch_size,
    )


def pack_share(
    samples: Sequence[RolloutSample],
    config: RLConfig,
    runtime: Runtime,
    *,
    temperature: float,
    pad_token_id: int,
    num_micro_batches: int,
) -> tuple[RLMicroBatch, ...]:
    """A rank's share of a step's samples packed into its rows (batch_size / dp of them) of
    `num_micro_batches` micro-batches. The packing fits each rank's rows to its samples; every
    rank must still run the same number of micro-batches (fnt.update), so the caller gives the
    most any share needs and the shorter shares get all-padding ones. Pure."""
    return pack_rollouts(
        samples,
        num_rows=config.batch_size // runtime.dims.dp,
        seq_len=config.seq_len,
        micro_batch_size=config.micro_batch_size,
        temperature=temperature,
        pad_token_id=pad_token_id,
        num_micro_batches=num_micro_batches,
    )


def save_and_pack_(
    samples: Sequence[RolloutSample],
    step: int,
    config: RLConfig,
    runtime: Runtime,
    tokenizer: Any,
    *,
    temperature: float,
    pad_token_id: int,
    num_micro_batches: int,
) -> tuple[RLMicroBatch, ...]:
    """A rank's samples of update `step`, saved as text on a sample step (every rank's, by rank
    0 after an all-gather: fnt.rollout.saved_samples) and packed (`pack_share`): what every
    engine does with a step's samples."""
    save_samples_(config, runtime, step, samples, tokenizer)
    return pack_share(
        samples,
        config,
        runtime,
        temperature=temperature,
        pad_token_id=pad_token_id,
        num_micro_batches=num_micro_batches,
    )


def run_prompts(
    rollout: RolloutConfig, environment: Any, name: str, tokenizer: Any
) -> tuple[tuple[Prompt, ...], tuple[int, ...], tuple[float, ...], str]:
    """A run's prompts, their sources' sizes and weights (empty: one source) and how messages
    name them: rollout.prompts' records, or the "train" prompt sources of an environment that
    makes its own (fnt.rollout.environments.protocol)."""
    if not supplies_prompts(rollout):
        return load_prompts(rollout.prompts, tokenizer, environment.start), (), (), rollout.prompts
    where = f"the training prompts of {name}"
    prompts, sizes, weights = source_prompts(
        environment.prompt_sources("train"), tokenizer, environment.start, where
    )
    return prompts, sizes, weights, where


def has_signal(group: Sequence[RolloutSample]) -> bool:
    """Whether a prompt's group carries a policy-gradient signal: some advantage a sample trains
    on is not zero (its `token_advantages` with rollout.credit = "turn", else its `advantage`).
    Group-relative advantages are exactly zero when the rewards are all equal (or the group was
    skipped for a bad reward, or one episode is left of it: fnt.rollout.advantages). Pure."""
    return any(
        sample.advantage != 0.0
        if sample.token_advantages is None
        else any(a != 0.0 for a in sample.token_advantages)
        for sample in group
    )


def filter_metrics(rounds: int, filtered: int, exhausted: int) -> dict[str, float]:
    """The metrics of a step that filtered its groups (rollout.filter_groups). Pure.

    rollout/filter_rounds: sampling rounds the step took (1: none was filtered);
    rollout/filtered_groups: groups without signal replaced by new prompts' groups;
    rollout/filter_exhausted_groups: groups without signal the step trains on because its
    rounds ran out (rollout.filter_max_rounds)."""
    return {
        "rollout/filter_rounds": float(rounds),
        "rollout/filtered_groups": float(filtered),
        "rollout/filter_exhausted_groups": float(exhausted),
    }


def mixture_metrics(
    samples: Sequence[RolloutSample], names: Sequence[str], runtime: Runtime
) -> dict[str, float]:
    """Each mixture member's episodes and mean reward over all ranks (a collective when
    distributed): rollout/{name}/episodes, and rollout/{name}/reward over its finite rewards
    (NaN when it has none this step). Every member of `names` has both keys every step, so
    every row has the same keys."""
    sums = []
    for name in names:
        ends = [s for s in samples if s.environment == name and not s.continued]
        good = [s.reward for s in ends if math.isfinite(s.reward)]
        sums += [float(len(ends)), float(len(good)), float(sum(good))]
    tensor = torch.tensor(sums, dtype=torch.float64, device=runtime.device)
    totals = all_reduce_sum(tensor, runtime.distributed).tolist()
    metrics = {}
    for i, name in enumerate(names):
        episodes, scored, total = totals[3 * i : 3 * i + 3]
        metrics[f"rollout/{name}/episodes"] = episodes
        metrics[f"rollout/{name}/reward"] = total / scored if scored else math.nan
    return metrics


def rollout_policy_step(step: int, async_level: int) -> int:
    """The policy step (updates done) whose weights sample the rollouts of update `step`. Pure."""
    return max(0, step - 1 - async_level)


def check_prompt_lengths(
    prompts: Sequence[Prompt],
    path: str,
    *,
    max_new_tokens: int,
    seq_len: int,
    budget: Optional[int] = None,
) -> None:
    """DataError for the first prompt whose first turn would not fit in seq_len (or the episode
    token budget, rollout.max_episode_tokens, when it is below seq_len)."""
    limit = seq_len if budget is None else min(budget, seq_len)
    what = f"seq_len = {seq_len}" if limit == seq_len else f"rollout.max_episode_tokens = {limit}"
    for prompt in prompts:
        length = len(prompt.token_ids)
        longest = length + max_new_tokens
        if longest > limit:
            raise DataError(
                f"{path}, line {prompt.line}: the prompt has {length} tokens, so with "
                f"rollout.max_new_tokens = {max_new_tokens} a sample can have {longest} tokens, "
                f"more than {what}: raise {what.split(' =')[0]} or lower rollout.max_new_tokens"
            )


NamedSums = dict[str, list[float]]
"""Named rewards' sums: name -> [count, sum] of its values (fnt.rollout.environments.protocol)."""


def merge_named_sums(parts: Iterable[Mapping[str, Sequence[float]]]) -> NamedSums:
    """The named-reward sums of all `parts` (each name -> (count, sum)) added up, names in the
    order they first appear. Pure."""
    merged: NamedSums = {}
    for part in parts:
        for name, (count, total) in part.items():
            pair = merged.setdefault(name, [0.0, 0.0])
            pair[0] += count
            pair[1] += total
    return merged


def named_sums(named: Iterable[tuple[str, float]]) -> NamedSums:
    """The sums of named reward values, each (name, value) counting once. Pure."""
    return merge_named_sums({name: (1.0, value)} for name, value in named)


def all_ranks_named_sums(named: NamedSums, runtime: Runtime) -> NamedSums:
    """The named-reward sums of every rank added up (a collective when distributed). The names
    may differ between ranks (each scored other samples), so they travel as objects."""
    return merge_named_sums(all_gather_objects(named, runtime.distributed))


def named_reward_means(named: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """reward/{name}/mean of each named reward, by name. Pure."""
    return {f"reward/{name}/mean": total / count for name, (count, total) in sorted(named.items())}


def reward_metrics(count: float, reward_sum: float, reward_sq: float) -> dict[str, float]:
    """reward/mean and reward/std (population) from the count, sum and sum of squares. Pure."""
    mean = reward_sum / count
    return {"reward/mean": mean, "reward/std": math.sqrt(max(reward_sq / count - mean**2, 0.0))}


# The per-step sums of `episode_sums`, in the order they are all-reduced.
EPISODE_SUMS = (
    "episodes",
    "scored",
    "reward_sum",
    "reward_sq",
    "bad_rewards",
    "sampled_tokens",
    "context_tokens",
    "turns",
    "tool_calls",
    "tool_errors",
    "truncated",
    "out_of_turns",
    "env_failures",
)


def episode_sums(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """The sums over `samples` that the episode metrics are made of (EPISODE_SUMS), plus
    `reward/{name}` -> (count, sum) pairs of the named rewards, under "named". Pure."""
    # An episode whose history was rewritten has several samples; it counts on its last.
    ends = [s for s in samples if not s.continued]
    rewards = torch.tensor([s.reward for s in ends], dtype=torch.float64)
    good = rewards[torch.isfinite(rewards)]
    sampled = [s.sampled_count for s in samples]
    return {
        "episodes": float(len(ends)),
        "scored": float(len(good)),
        "reward_sum": float(good.sum()),
        "reward_sq": float((good**2).sum()),
        "bad_rewards": float(len(rewards) - len(good)),
        "sampled_tokens": float(sum(sampled)),
        "context_tokens": float(sum(s.length for s in samples) - sum(sampled)),
        "turns": float(sum(s.turns for s in samples)),
        "tool_calls": float(sum(s.tool_calls for s in samples)),
        "tool_errors": float(sum(s.tool_errors for s in samples)),
        "truncated": float(sum(s.truncated for s in samples)),
        "out_of_turns": float(sum(s.out_of_turns for s in samples)),
        # An environment's worker crashed or hung (fnt.rollout.environments.pooled).
        "env_failures": float(sum(getattr(s, "env_failed", False) for s in samples)),
        "named": named_sums(pair for s in samples for pair in s.named_rewards),
    }


def episode_metrics(sums: dict[str, float], dropped: float = 0.0) -> dict[str, float]:
    """The per-step metrics of the episodes from their (all-rank) `episode_sums`. Pure.

    reward/* are over the finite rewards (NaN when there are none); rollout/bad_rewards counts
    the NaN/inf ones; rollout/completion_len/mean is the sampled tokens per episode (a
    single-turn sample's completion length); rollout/truncated_* count the episodes a length
    limit cut (max_new_tokens, max_episode_tokens) and rollout/max_turns_* those that ran out of
    turns (rollout.max_turns): two outcomes, an episode has at most one
    (fnt.rollout.environments.episodes); rollout/dropped_episodes counts the truncated episodes
    rollout.on_truncated = "drop" left out of the batch; rollout/env_failures counts the episodes
    whose environment failed (EnvironmentFailed: a crashed or hung worker).
    """
    n, nan = sums["episodes"], math.nan
    rewards = (
        reward_metrics(sums["scored"], sums["reward_sum"], sums["reward_sq"])
        if sums["scored"]
        else {}
    )

    def per_episode(key: str) -> float:
        return sums[key] / n if n else nan

    metrics = {
        "reward/mean": rewards.get("reward/mean", nan),
        "reward/std": rewards.get("reward/std", nan),
        "rollout/completion_len/mean": per_episode("sampled_tokens"),
        "rollout/truncated_fraction": per_episode("truncated"),
        "rollout/max_turns_fraction": per_episode("out_of_turns"),
        "rollout/bad_rewards": sums["bad_rewards"],
        "rollout/episodes": n,
        "rollout/turns/mean": per_episode("turns"),
        "rollout/tool_calls/mean": per_episode("tool_calls"),
        "rollout/tool_errors/mean": per_episode("tool_errors"),
        "rollout/truncated_episodes": sums["truncated"],
        "rollout/max_turns_episodes": sums["out_of_turns"],
        "rollout/dropped_episodes": float(dropped),
        "rollout/env_failures": sums.get("env_failures", 0.0),
        "rollout/sampled_tokens": sums["sampled_tokens"],
        "rollout/context_tokens": sums["context_tokens"],
    }
    return {**metrics, **named_reward_means(sums.get("named", {}))}


def rollout_metrics(
    samples: Sequence[RolloutSample],
    seconds: float,
    runtime: Runtime,
    *,
    generation_seconds: Optional[float] = None,
    dropped: int = 0,
) -> dict[str, float]:
    """`episode_metrics`, time/rollout and rollout/tokens_per_second over all ranks;
    collectives when distributed.

    time/rollout is the slowest rank's `seconds` (the step waits for it); tokens_per_second
    counts the sampled tokens of all ranks over the slowest rank's generation_seconds (when
    generation ran in the background; else over time/rollout). rollout.on_bad_reward = "skip"
    gave the groups of NaN/inf rewards zero advantages.
    """
    sums = episode_sums(samples)
    named = sums.pop("named")
    totals = torch.tensor(
        [sums[key] for key in EPISODE_SUMS] + [float(dropped)],
        dtype=torch.float64,
        device=runtime.device,
    )
    totals = all_reduce_sum(totals, runtime.distributed).tolist()
    sums = dict(zip(EPISODE_SUMS, totals))
    sums["named"] = all_ranks_named_sums(named, runtime)
    generating = seconds if generation_seconds is None else generation_seconds
    seconds, generating = all_reduce_max([seconds, generating], runtime)
    return {
        **episode_metrics(sums, dropped=totals[-1]),
        "time/rollout": seconds,
        "rollout/tokens_per_second": sums["sampled_tokens"] / generating if generating > 0 else 0.0,
    }
