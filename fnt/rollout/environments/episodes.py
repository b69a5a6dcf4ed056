"""The episodes of one rank's step, run turn by turn, and their scored samples. Pure, except
for what the engine's sampler and the environment do.

The first turn samples group_size completions of each prompt, as a single-turn rollout always
has (so a single-turn environment's samples are exactly those of before); each later turn
samples one continuation of its episode. After every turn the environment answers or ends the
episode, and the reply's tokens are appended after the sampled ones
(fnt.rollout.environments.render). Episodes advance on their own (`run_independent`, the
default): an episode's next turn is asked for as soon as its environment has answered, from an
engine that samples turns as they come (`TurnStream`: the in-process engine batches them
continuously, fnt.rollout.continuous; the vLLM engine sends each as its own request), and the
environment's calls run concurrently on up to rollout.env_concurrency threads (an async
environment's coroutines on fnt's event loop, fnt.rollout.user_code), so an episode never waits
for another's turn or tool; an episode that ends is scored on those threads while the others
run. Each turn draws from a generator of its own, seeded by (seed, step,
slot, episode, turn), so the samples do not depend on the order in which episodes finish.
Under rollout.lockstep = true (and with an engine that cannot stream turns, or one model turn
per episode) every turn is one batched call over the episodes still running and the
environment answers them one after another (`run_lockstep`): the schedule before
rollout.lockstep existed, kept to measure against.

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

Credit (rollout.credit): "episode" gives the episode's advantage, its reward against its
group's (fnt.rollout.advantages.group_advantages), to every sampled token. "turn" asks the
environment for a reward per model turn (`score_turns`, fnt.rollout.environments.protocol), adds
the episode's score to the last turn's, and gives each turn's tokens the advantage of its
discounted return-to-go (rollout.turn_discount) against those of the group's episodes at the
same turn (fnt.rollout.advantages.turn_advantages); the sample's `advantage` is then its first
turn's.
An episode zeroed by rollout.on_truncated = "zero" has all turn rewards 0, unasked.

Context that changes: an environment that rewrites the conversation (a Reply with `history`,
a summary in place of old turns) ends the episode's sample after the turn, and the episode goes
on in a new one that starts with the template's rendering of the history and the reply (with
the generation prompt), as prime-rl splits an episode where its context stops being a prefix.
Every sample of the episode trains on the episode's advantage (under turn credit, on its turns'
own); the episode's reward and facts (tool calls, truncation, running out of turns) are on its
last sample, and the earlier ones are `continued`, so an episode counts once in the metrics.
Each sample must fit rollout.max_episode_tokens; `respond` and `score` then see the rewritten
conversation, and `score_turns` still rewards every model turn of the episode.

An environment that raises EnvironmentFailed (its worker crashed or hung,
fnt.rollout.environments.pooled) ends the episode: it is worth the environment's
`failure_reward` (default 0.0; `score` is not asked, and under turn credit every turn earns 0),
an ordinary finite reward, so the group trains on it whatever rollout.on_bad_reward says (code
that hangs the sandbox deserves a low reward), and `env_failed` on its sample counts it in
rollout/env_failures.
"""

from __future__ import annotations

import math
import numbers
import queue
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

from fnt.errors import ConfigError, UserCodeError
from fnt.rollout.advantages import discounted_returns, group_advantages, turn_advantages
from fnt.rollout.environments.parsers import TurnParser, read_turn, turn_parser
from fnt.rollout.environments.protocol import (
    Environment,
    EnvironmentFailed,
    Reply,
    Scored,
    weighted_reward,
)
from fnt.rollout.environments.render import reply_ids
from fnt.rollout.pack import RolloutSample
from fnt.rollout.prompts import Prompt, render_prompt
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
    credit: str = "episode"  # rollout.credit: "episode" or "turn" (module docstring)
    turn_discount: float = 1.0  # rollout.turn_discount, for credit "turn"
    lockstep: bool = False  # rollout.lockstep: every turn waits for all episodes
    env_concurrency: int = 8  # rollout.env_concurrency: environment calls at once


@dataclass(frozen=True)
class EpisodeSample(RolloutSample):
    """A scored episode: its RolloutSample (fnt.rollout.pack, which says whether it ran out of
    turns, an outcome of its own beside `truncated`) and what only an episode runner knows."""

    turn_rewards: tuple[float, ...] = ()
    """rollout.credit = "turn": the reward of each model turn, before the score is added to
    the last one's; () under episode credit."""
    env_failed: bool = False
    """The environment failed on the episode (EnvironmentFailed): it ended and is worth the
    environment's failure_reward."""


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

    def stream(self) -> Optional["TurnStream"]:
        """The engine's sampler of turns as they come, or None when it samples only in
        lockstep (a model whose cache drops tokens, in-process)."""
        ...


Delivery = Callable[[tuple[int, int, int], Union[Completion, BaseException]], None]
"""How a TurnStream hands over a sampled turn: (slot, episode, turn) and its completion, or the
exception that failed it; called from any thread."""


class TurnStream(Protocol):
    """What an engine does for episodes that advance on their own: sample turns as they are
    asked for, each handed over as soon as it is done."""

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        max_new_tokens: int,
        deliver: Delivery,
    ) -> None:
        """Sample num_samples first turns of each prompt, each delivered as ((the prompt's index,
        the episode's index in its group, 1), completion); later turns are delivered so too."""
        ...

    def submit(self, context: Sequence[int], max_new_tokens: int, key: tuple[int, int, int]):
        """Sample one continuation of `context` (turn key[2] of episode key[1] of slot key[0])."""
        ...

    def work(self) -> bool:
        """Do what must run in the calling thread (in-process: one decode step, delivering the
        turns it finished); False when nothing does (what is in flight is delivered from other
        threads)."""
        ...

    def end(self, slot: int, index: int) -> None:
        """Episode `index` of prompt `slot` has ended: let go of what is kept for its next turn
        (in-process: its KV cache), while the other episodes still run."""
        ...

    def settle_(self, episodes: Sequence[Sequence["Episode"]]) -> None:
        """After the last turn: make what the episodes recorded independent of how their turns
        were batched (in-process: logprobs from each episode alone, fnt.rollout.continuous)."""
        ...


@dataclass(frozen=True)
class Branch:
    """One training sample of an episode whose history was rewritten (module docstring)."""

    token_ids: tuple[int, ...]
    sampled: tuple[bool, ...]
    logprobs: tuple[float, ...]
    turn_spans: tuple[tuple[int, int], ...]


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
    env_failed: bool = False  # the environment raised EnvironmentFailed (module docstring)
    running: bool = True
    named: Optional[Scored] = field(default=None)
    # [start, end) of each model turn's sampled tokens in token_ids, in turn order.
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    # The samples the episode closed when its environment rewrote the history, in order.
    closed: list[Branch] = field(default_factory=list)
    # Its score being computed (`score_soon`), when it ended among running episodes.
    scoring: Optional[Future] = None

    def branches(self) -> list[Branch]:
        """The episode's samples: the closed ones and the one in progress."""
        current = Branch(
            tuple(self.token_ids), tuple(self.sampled), tuple(self.logprobs), tuple(self.turn_spans)
        )
        return [*self.closed, current]

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
    if not take_turn_(episode, completion, environment, tokenizer, rules):
        return
    try:
        reply = respond(episode, environment, rules)
    except EnvironmentFailed:
        episode.env_failed, episode.running = True, False
        return
    take_reply_(episode, reply, completion, tokenizer, rules)


def take_turn_(
    episode: Episode,
    completion: Completion,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> bool:
    """Append a sampled turn to the episode; whether the environment is to answer it (else the
    episode ended: a length cut)."""
    message = read_turn(
        tokenizer,
        rules.turn_parser or turn_parser(getattr(tokenizer, "chat_template", None)),
        completion.token_ids,
        stopped=completion.stopped,
        context_ids=episode.token_ids,
        tools=episode.prompt.tools,
        keep_special_tokens=getattr(environment, "keep_special_tokens", True),
    )
    start = len(episode.token_ids)
    episode.turn_spans.append((start, start + len(completion.token_ids)))
    episode.token_ids += completion.token_ids
    episode.sampled += [True] * len(completion.token_ids)
    episode.logprobs += completion.logprobs
    episode.turns += 1
    episode.messages.append(message)
    if not completion.stopped:
        episode.truncated, episode.running = True, False
        return False
    return True


def respond(episode: Episode, environment: Environment, rules: EpisodeRules) -> Optional[Reply]:
    """The environment's answer to the episode's last turn (what its `respond` returns, checked
    in `take_reply_`); EnvironmentFailed passes, what else it raises is a UserCodeError. It may
    run in any thread."""
    what = f"{rules.name} failed to answer turn {episode.turns} on {episode.where(rules)}"
    return call_environment(environment.respond, what, episode)


def call_environment(method, what: str, episode: Episode) -> Any:
    """An environment's `method(record, messages)` on the episode's record and conversation so
    far, through call_user (`what` names it in an error); EnvironmentFailed passes."""
    record, messages = episode.prompt.record, list(episode.messages)
    return call_user(method, what, record, messages, passes=(EnvironmentFailed,))


def take_reply_(
    episode: Episode,
    reply: Any,
    completion: Completion,
    tokenizer,
    rules: EpisodeRules,
) -> None:
    """Append the environment's reply to the episode's last turn (`completion`) or end the
    episode (module docstring)."""
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
    if reply.history is not None:
        restart_(episode, reply, tokenizer, rules)
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


def restart_(episode: Episode, reply: Reply, tokenizer, rules: EpisodeRules) -> None:
    """Close the episode's sample and go on in a new one from the rewritten conversation
    `reply.history` + `reply.messages` (module docstring); truncated when that leaves no room
    for a sampled token."""
    messages = [dict(m) for m in (*reply.history, *reply.messages)]
    try:
        ids = render_prompt(messages, tokenizer, episode.prompt.tools)
    except ValueError as e:
        raise ValueError(
            f"{rules.name}: turn {episode.turns} on {episode.where(rules)}: {e}"
        ) from None
    if len(ids) >= rules.max_episode_tokens:
        episode.truncated, episode.running = True, False
        return
    episode.closed = episode.branches()
    episode.token_ids, episode.sampled = list(ids), [False] * len(ids)
    episode.logprobs, episode.turn_spans = [0.0] * len(ids), []
    episode.messages = messages


def run_episodes(
    prompts: Sequence[Prompt],
    sampler: TurnSampler,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> list[list[Episode]]:
    """Every episode of `prompts` (group_size each) run to its end: on its own
    (`run_independent`), or in lockstep (`run_lockstep`) under rollout.lockstep, with one model
    turn per episode, or when the sampler cannot stream turns (module docstring)."""
    stream = None
    if not rules.lockstep and rules.max_turns > 1:
        stream = getattr(sampler, "stream", lambda: None)()
    if stream is None:
        return run_lockstep(prompts, sampler, environment, tokenizer, rules)
    return run_independent(prompts, stream, environment, tokenizer, rules)


def new_episodes(prompts: Sequence[Prompt], rules: EpisodeRules) -> list[list[Episode]]:
    """group_size episodes of each prompt, none sampled yet."""
    return [
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


def turn_limit(episode: Episode, rules: EpisodeRules) -> int:
    """The most tokens the episode's next turn may sample."""
    return min(rules.max_new_tokens, rules.max_episode_tokens - len(episode.token_ids))


def run_lockstep(
    prompts: Sequence[Prompt],
    sampler: TurnSampler,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> list[list[Episode]]:
    """Every episode of `prompts` run to its end in batched turns: each turn waits for all
    episodes still running, and the environment answers them one after another."""
    episodes = new_episodes(prompts, rules)
    groups = sampler.first([p.token_ids for p in prompts], rules.group_size, rules.max_new_tokens)
    for group, completions in zip(episodes, groups):
        for episode, completion in zip(group, completions):
            advance_(episode, completion, environment, tokenizer, rules)
    turn = 1
    while running := [e for group in episodes for e in group if e.running]:
        turn += 1
        completions = sampler.next(
            [e.token_ids for e in running],
            [turn_limit(e, rules) for e in running],
            [(e.slot, e.index, turn) for e in running],
        )
        for episode, completion in zip(running, completions):
            advance_(episode, completion, environment, tokenizer, rules)
    return episodes


def run_independent(
    prompts: Sequence[Prompt],
    stream: TurnStream,
    environment: Environment,
    tokenizer,
    rules: EpisodeRules,
) -> list[list[Episode]]:
    """Every episode of `prompts` run to its end on its own: a sampled turn goes to the
    environment at once (on a pool of rollout.env_concurrency threads), and its reply to the
    stream for the next turn at once. What the stream or the environment raises is raised
    here, after the calls not yet started are cancelled."""
    episodes = new_episodes(prompts, rules)
    events: queue.SimpleQueue = queue.SimpleQueue()
    pool = ThreadPoolExecutor(max_workers=rules.env_concurrency, thread_name_prefix="fnt-env")

    def on_turn(key: tuple[int, int, int], result: Union[Completion, BaseException]) -> None:
        events.put((key, result, None))

    def on_reply(key: tuple[int, int, int], completion: Completion, future: Future) -> None:
        events.put((key, completion, future))

    def ask(episode: Episode, completion: Completion) -> None:
        key = (episode.slot, episode.index, episode.turns)
        future = pool.submit(respond, episode, environment, rules)
        future.add_done_callback(lambda f: on_reply(key, completion, f))

    in_flight = len(prompts) * rules.group_size  # turns sampling and calls answering
    try:
        stream.start(
            [p.token_ids for p in prompts], rules.group_size, rules.max_new_tokens, on_turn
        )
        while in_flight:
            ready = [] if stream.work() else [events.get()]
            while True:
                try:
                    ready.append(events.get_nowait())
                except queue.Empty:
                    break
            for (slot, index, _), result, reply in ready:
                in_flight -= 1
                if isinstance(result, BaseException):
                    raise result
                episode = episodes[slot][index]
                if reply is None:  # a sampled turn
                    if take_turn_(episode, result, environment, tokenizer, rules):
                        ask(episode, result)
                        in_flight += 1
                    else:
                        stream.end(slot, index)
                        score_soon(episode, environment, rules, pool)
                    continue
                try:
                    take_reply_(episode, reply.result(), result, tokenizer, rules)
                except EnvironmentFailed:
                    episode.env_failed, episode.running = True, False
                if episode.running:
                    key = (slot, index, episode.turns + 1)
                    stream.submit(episode.token_ids, turn_limit(episode, rules), key)
                    in_flight += 1
                else:
                    stream.end(slot, index)
                    score_soon(episode, environment, rules, pool)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)  # the scores still being computed
    stream.settle_(episodes)
    return episodes


def score_soon(
    episode: Episode, environment: Environment, rules: EpisodeRules, pool: ThreadPoolExecutor
) -> None:
    """Start scoring an episode that ended on the pool, beside the running episodes' turns
    (`scored_samples` takes the result); nothing for one rollout.on_truncated zeroes or drops,
    and under turn credit (its scores come with the turn rewards)."""
    if rules.credit == "episode" and not (episode.truncated and rules.on_truncated != "score"):
        episode.scoring = pool.submit(score_episode, episode, environment, rules)


def score_episode(episode: Episode, environment: Environment, rules: EpisodeRules) -> Scored:
    """The episode's reward from the environment; a UserCodeError naming it, the prompt and the
    episode when it raises or returns what is not a reward. Under rollout.on_bad_reward = "skip"
    a raise scores NaN instead, so the episode's group is skipped and counted as a bad reward."""
    if episode.env_failed:
        return Scored(failure_reward(environment))
    where = episode.where(rules)
    last = episode.messages[-1].get("content") if episode.messages else None
    what = f"{rules.name} failed on {where} (episode {episode.index}, last turn {shown(last)})"
    try:
        value = call_environment(environment.score, what, episode)
    except EnvironmentFailed:
        episode.env_failed = True
        return Scored(failure_reward(environment))
    except UserCodeRaised:
        if rules.on_bad_reward == "skip":
            return Scored(math.nan)
        raise
    weights = getattr(environment, "reward_weights", None) or {}
    try:
        return weighted_reward(value, weights, rules.name, where)
    except ValueError as e:
        raise UserCodeError(str(e)) from None


def failure_reward(environment: Environment) -> float:
    """What an episode whose environment failed is worth: its `failure_reward` (default 0.0)."""
    return float(getattr(environment, "failure_reward", 0.0))


def require_turn_scores(environment: Environment, rules: EpisodeRules) -> None:
    """ConfigError when rollout.credit = "turn" and the environment cannot score turns (it has
    no `score_turns` method, fnt.rollout.environments.protocol)."""
    if rules.credit == "turn" and not callable(getattr(environment, "score_turns", None)):
        raise ConfigError(
            f"'rollout.credit' = 'turn': {rules.name} does not score turns; give it a method "
            "score_turns(record, messages) returning one reward per model turn "
            '(fnt.rollout.environments.protocol), or use rollout.credit = "episode"'
        )


def score_turns(episode: Episode, environment: Environment, rules: EpisodeRules) -> list[float]:
    """The reward of each model turn of the episode from the environment's `score_turns`; a
    UserCodeError naming it, the prompt and the episode when it raises or returns anything but
    one real number per turn. Under rollout.on_bad_reward = "skip" a raise gives NaNs, so the
    group is skipped as for a bad score."""
    if episode.env_failed:
        return [0.0] * episode.turns
    where = episode.where(rules)
    what = f"{rules.name} (its score_turns) failed on {where} (episode {episode.index})"
    try:
        value = call_environment(environment.score_turns, what, episode)
    except EnvironmentFailed:
        episode.env_failed = True
        return [0.0] * episode.turns
    except UserCodeRaised:
        if rules.on_bad_reward == "skip":
            return [math.nan] * episode.turns
        raise
    if (
        isinstance(value, (str, bytes, Mapping))
        or not isinstance(value, Sequence)
        or len(value) != episode.turns
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    ):
        raise UserCodeError(
            f"{rules.name} (its score_turns) returned {shown(value)} on {where} (episode "
            f"{episode.index}); expected a list of one float per model turn ({episode.turns})"
        )
    return [float(v) for v in value]


def turn_credit(
    kept: Sequence[Episode],
    scores: Sequence[Scored],
    environment: Environment,
    rules: EpisodeRules,
) -> Optional[tuple[list[list[float]], list[list[float]]]]:
    """Per episode of a group, its turn rewards and each turn's advantage (module docstring),
    or None when a NaN/inf turn reward skips the group (rollout.on_bad_reward = "skip")."""
    rewards = [
        [0.0] * e.turns
        if e.truncated and rules.on_truncated == "zero"
        else score_turns(e, environment, rules)
        for e in kept
    ]
    name = f"{rules.reward_name} (its score_turns)"
    flat = [r for episode in rewards for r in episode]
    if not keep_group(flat, rules.on_bad_reward, kept[0].where(rules), name):
        return None
    returns = [
        discounted_returns([*r[:-1], r[-1] + s.reward], rules.turn_discount)
        for r, s in zip(rewards, scores)
    ]
    return rewards, turn_advantages(returns, std_normalize=rules.std_normalize)


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
            else e.scoring.result()
            if e.scoring is not None
            else score_episode(e, environment, rules)
            for e in kept
        ]
        rewards = [s.reward for s in scores]
        where = kept[0].where(rules)
        keep = keep_group(rewards, rules.on_bad_reward, where, rules.reward_name)
        if keep and rules.credit == "turn":
            credit = turn_credit(kept, scores, environment, rules)
            if credit is not None:
                samples += turn_samples(kept, scores, *credit, policy_step)
                continue
            keep = False
        if keep:
            advantages = group_advantages([rewards], std_normalize=rules.std_normalize)[0].tolist()
        else:
            advantages = [0.0] * len(rewards)
        for e, score, advantage in zip(kept, scores, advantages):
            samples += episode_samples(e, score, advantage, policy_step)
    return samples, dropped


def turn_samples(
    kept: Sequence[Episode],
    scores: Sequence[Scored],
    rewards: Sequence[Sequence[float]],
    advantages: Sequence[Sequence[float]],
    policy_step: Optional[int],
) -> list[EpisodeSample]:
    """A group's samples under rollout.credit = "turn": each token trains on its turn's
    advantage, and a sample's `advantage` is its first turn's."""
    samples: list[EpisodeSample] = []
    for e, score, r, a in zip(kept, scores, rewards, advantages):
        samples += episode_samples(e, score, a[0], policy_step, turns=(a, r))
    return samples


def episode_samples(
    episode: Episode,
    score: Scored,
    advantage: float,
    policy_step: Optional[int],
    turns: Optional[tuple[Sequence[float], Sequence[float]]] = None,
) -> list[EpisodeSample]:
    """The samples of a scored episode, one per branch (module docstring), with the episode's
    reward and `advantage` on every token; under turn credit `turns` is (the advantage, the
    reward) of each model turn, and each token carries its turn's advantage and a sample's
    `advantage` is its first turn's."""
    branches = episode.branches()
    samples, first = [], 0
    for n, branch in enumerate(branches):
        last = n == len(branches) - 1
        count = episode.turns - first if last else len(branch.turn_spans)
        numbers = range(first, first + count)
        first += count
        per_token, turn_rewards, branch_advantage = None, (), advantage
        if turns is not None:
            turn_advantages, rewards = turns
            values = [0.0] * len(branch.token_ids)
            for (start, end), k in zip(branch.turn_spans, numbers):
                values[start:end] = [turn_advantages[k]] * (end - start)
            per_token = tuple(values)
            turn_rewards = tuple(rewards[k] for k in numbers)
            branch_advantage = turn_advantages[numbers[0]] if numbers else advantage
        samples.append(
            EpisodeSample(
                token_ids=branch.token_ids,
                sampled=branch.sampled,
                logprobs=branch.logprobs,
                reward=score.reward,
                advantage=branch_advantage,
                turns=count,
                tool_calls=episode.tool_calls if last else 0,
                tool_errors=episode.tool_errors if last else 0,
                truncated=episode.truncated and last,
                policy_step=policy_step,
                named_rewards=score.named if last else (),
                continued=not last,
                token_advantages=per_token,
                out_of_turns=episode.out_of_turns and last,
                turn_rewards=turn_rewards,
                env_failed=episode.env_failed and last,
            )
        )
    return samples
