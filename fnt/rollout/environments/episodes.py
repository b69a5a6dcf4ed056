"""The episodes of one rank's step, run turn by turn, and their scored samples. Pure, except
for what the engine's sampler and the environment do.

All episodes of a step advance together: a turn is one batched sampling call over every
episode still running (`TurnSampler`), and an episode that ends leaves the batch. The first
turn samples group_size completions of each prompt, as a single-turn rollout always has (so a
single-turn environment's samples are exactly those of before); each later turn samples one
continuation per running episode. After every turn the environment answers or ends the
episode, and the reply's tokens are appended after the sampled ones
(fnt.rollout.environments.render).

Two limits end an episode early, and they are two outcomes. Truncation is a length cut: a turn
cut off by max_new_tokens or by the episode's token budget (rollout.max_episode_tokens: 0 means
seq_len), or a reply that leaves no room for another sampled token. Running out of turns is not:
the environment answered the last turn rollout.max_turns allows (it would have gone on), so the
episode's last turn is complete and the environment scores it as it is
(`Episode.out_of_turns`, rollout/max_turns_fraction). rollout.on_truncated decides what a
truncated episode is worth, and only that: "score" scores it as it is, "zero" gives it reward 0
without asking the environment, "drop" leaves it out of the batch (its group's advantages come
from the others); rollout/truncated_episodes and rollout/dropped_episodes count them. Zeroing
or dropping out-of-turns episodes would make a wrong last answer missing rather than wrong (a
group that drops its failures trains on its successes alone); an environment that wants such
an episode worth less says so in its `score`, which sees the whole conversation. A
trajectory always ends with its last sampled token: a reply after which nothing was sampled is
not part of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from fnt.errors import UserCodeError
from fnt.rollout.advantages import group_advantages
from fnt.rollout.environments.parsers import TurnParser, read_turn, turn_parser
from fnt.rollout.environments.protocol import Environment, Reply, Scored, weighted_reward
from fnt.rollout.environments.render import reply_ids
from fnt.rollout.pack import RolloutSample
from fnt.rollout.prompts import Prompt
from fnt.rollout.rewards import keep_group
from fnt.rollout.sampling import Completion
from fnt.rollout.user_code import UserCodeRaised, call_user, shown


@dataclass(frozen=True)
class EpisodeRules:
    """The settings episodes run by (from rollout.* and seq_len)."""

    group_size: int
    max_new_tokens: int
    max_turns: int
    max_episode_tokens: int  # the resolved budget: rollout.max_episode_tokens or seq_len
    on_truncated: str  # "score", "zero" or "drop"
    on_bad_reward: str
    std_normalize: bool
    prompts_path: str
    name: str  # how errors name the environment: "reward 'x'" or "environment 'm:f'"
    reward_name: str  # what scores the episodes: rollout.reward, or rollout.environment
    # How turns are read (rollout.tool_parser, reasoning_parser); None: "auto" for both.
    turn_parser: Optional[TurnParser] = None


@dataclass(frozen=True)
class EpisodeSample(RolloutSample):
    """A scored episode: its RolloutSample (fnt.rollout.pack) and whether it ran out of turns,
    an outcome of its own beside `truncated` (module docstring)."""

    out_of_turns: bool = False
    """The environment answered the last turn rollout.max_turns allows; not truncation."""


def ran_out_of_turns(sample: RolloutSample) -> bool:
    """Whether the sample's episode ran out of turns (`EpisodeSample`); False for a sample that
    no episode runner made (an external orchestrator's). Pure."""
    return bool(getattr(sample, "out_of_turns", False))


class TurnSampler(Protocol):
    """What an engine does for the episodes: sample one batched turn."""

    def first(
        self, prompts: Sequence[Sequence[int]], num_samples: int, max_new_tokens: int
    ) -> list[list[Completion]]:
        """Per prompt, num_samples completions (the first turn of its group)."""
        ...

    def next(
        self,
        contexts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        keys: Sequence[tuple[int, int, int]],
    ) -> list[Completion]:
        """One completion per context, at most max_new_tokens[i] long; keys[i] is (the prompt's
        index among this call's prompts, the episode's index in its group, the turn, from 2)."""
        ...


@dataclass
class Episode:
    """One episode in flight: its flat tokens so far and its conversation."""

    prompt: Prompt
    slot: int  # the prompt's index among the rank's prompts of the step
    index: int  # the episode's index in its group
    token_ids: list[int]
    sampled: list[bool]
    logprobs: list[float]
    messages: list[Mapping[str, Any]]
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False  # a length cut (module docstring)
    out_of_turns: bool = False  # the environment answered the last allowed turn
    running: bool = True
    named: Optional[Scored] = field(default=None)

    def where(self, rules: EpisodeRules) -> str:
        return f"the prompt of line {self.prompt.line} of {rules.prompts_path}"


def advance_(
    episode: Episode,
    completion: Completion,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> None:
    """Append a sampled turn to the episode, ask the environment, and append its reply's tokens
    or end the episode (module docstring)."""
    message = read_turn(
        tokenizer,
        rules.turn_parser or turn_parser(getattr(tokenizer, "chat_template", None)),
        completion.token_ids,
        stopped=completion.stopped,
        context_ids=episode.token_ids,
        tools=episode.prompt.tools,
        keep_special_tokens=getattr(environment, "keep_special_tokens", True),
    )
    episode.token_ids += completion.token_ids
    episode.sampled += [True] * len(completion.token_ids)
    episode.logprobs += completion.logprobs
    episode.turns += 1
    episode.messages.append(message)
    if not completion.stopped:
        episode.truncated, episode.running = True, False
        return
    record = episode.prompt.record
    what = f"{rules.name} failed to answer turn {episode.turns} on {episode.where(rules)}"
    reply = call_user(environment.respond, what, record, list(episode.messages))
    if reply is None:
        episode.running = False
        return
    if not isinstance(reply, Reply):
        raise UserCodeError(
            f"{rules.name} answered turn {episode.turns} on {episode.where(rules)} with "
            f"{type(reply).__name__}; expected a Reply or None"
        )
    episode.tool_calls += reply.tool_calls
    episode.tool_errors += reply.tool_errors
    if episode.turns >= rules.max_turns:
        episode.out_of_turns, episode.running = True, False
        return
    try:
        ids = reply_ids(
            tokenizer, episode.messages, episode.prompt.tools, reply.messages, completion.token_ids
        )
    except ValueError as e:
        raise ValueError(
            f"{rules.name}: turn {episode.turns} on {episode.where(rules)}: {e}"
        ) from None
    if len(episode.token_ids) + len(ids) >= rules.max_episode_tokens:
        episode.truncated, episode.running = True, False
        return
    episode.token_ids += ids
    episode.sampled += [False] * len(ids)
    episode.logprobs += [0.0] * len(ids)
    episode.messages += [dict(m) for m in reply.messages]


def run_episodes(
    prompts: Sequence[Prompt],
    sampler: TurnSampler,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> list[list[Episode]]:
    """Every episode of `prompts` (group_size each) run to its end, in batched turns."""
    episodes = [
        [
            Episode(
                prompt=p,
                slot=slot,
                index=i,
                token_ids=list(p.token_ids),
                sampled=[False] * len(p.token_ids),
                logprobs=[0.0] * len(p.token_ids),
                messages=[dict(m) for m in p.messages],
            )
            for i in range(rules.group_size)
        ]
        for slot, p in enumerate(prompts)
    ]
    groups = sampler.first([p.token_ids for p in prompts], rules.group_size, rules.max_new_tokens)
    for group, completions in zip(episodes, groups):
        for episode, completion in zip(group, completions):
            advance_(episode, completion, environment, tokenizer, rules)
    turn = 1
    while running := [e for group in episodes for e in group if e.running]:
        turn += 1
        limits = [
            min(rules.max_new_tokens, rules.max_episode_tokens - len(e.token_ids)) for e in running
        ]
        completions = sampler.next(
            [e.token_ids for e in running], limits, [(e.slot, e.index, turn) for e in running]
        )
        for episode, completion in zip(running, completions):
            advance_(episode, completion, environment, tokenizer, rules)
    return episodes


def score_episode(episode: Episode, environment: Environment, rules: EpisodeRules) -> Scored:
    """The episode's reward from the environment; a UserCodeError naming it, the prompt and the
    episode when it raises or returns what is not a reward. Under rollout.on_bad_reward = "skip"
    a raise scores NaN instead, so the episode's group is skipped and counted as a bad reward."""
    where = episode.where(rules)
    last = episode.messages[-1].get("content") if episode.messages else None
    what = f"{rules.name} failed on {where} (episode {episode.index}, last turn {shown(last)})"
    try:
        value = call_user(environment.score, what, episode.prompt.record, list(episode.messages))
    except UserCodeRaised:
        if rules.on_bad_reward == "skip":
            return Scored(math.nan)
        raise
    weights = getattr(environment, "reward_weights", None) or {}
    try:
        return weighted_reward(value, weights, rules.name, where)
    except ValueError as e:
        raise UserCodeError(str(e)) from None


def scored_samples(
    episodes: Sequence[Sequence[Episode]],
    environment: Environment,
    rules: EpisodeRules,
    policy_step: Optional[int] = None,
) -> tuple[list[RolloutSample], int]:
    """Each group's episodes scored and given their group's advantages, as samples in prompt
    order, and how many truncated episodes rollout.on_truncated = "drop" left out (an episode
    that ran out of turns is scored, never zeroed or dropped)."""
    samples: list[RolloutSample] = []
    dropped = 0
    for group in episodes:
        kept = [e for e in group if not (e.truncated and rules.on_truncated == "drop")]
        dropped += len(group) - len(kept)
        if not kept:
            continue
        scores = [
            Scored(0.0)
            if e.truncated and rules.on_truncated == "zero"
            else score_episode(e, environment, rules)
            for e in kept
        ]
        rewards = [s.reward for s in scores]
        where = kept[0].where(rules)
        if keep_group(rewards, rules.on_bad_reward, where, rules.reward_name):
            advantages = group_advantages([rewards], std_normalize=rules.std_normalize)[0].tolist()
        else:
            advantages = [0.0] * len(rewards)
        samples += [
            EpisodeSample(
                token_ids=tuple(e.token_ids),
                sampled=tuple(e.sampled),
                logprobs=tuple(e.logprobs),
                reward=s.reward,
                advantage=advantage,
                turns=e.turns,
                tool_calls=e.tool_calls,
                tool_errors=e.tool_errors,
                truncated=e.truncated,
                policy_step=policy_step,
                named_rewards=s.named,
                out_of_turns=e.out_of_turns,
            )
            for e, s, advantage in zip(kept, scores, advantages)
        ]
    return samples, dropped
