"""The environment protocol: what an RL episode's conversation rules and reward look like to the
engines. Pure.

An environment is any object with three methods (the engine owns batching, sampling and tokens;
the environment owns the conversation and the reward):

    start(record) -> Start
        The first messages of the episode of a prompt record (a JSONL line of rollout.prompts),
        and the tools, as JSON schemas, the chat template renders (None: no tools).
    respond(record, messages) -> Reply | None
        Called after every model turn with the conversation so far (the first messages, each
        model turn as an assistant message, below, each earlier reply's messages): the
        messages that answer the turn (tool results, feedback), or None to end the episode.
        A Reply with `history` rewrites the conversation (a summary in place of old turns):
        the episode goes on in a new training sample (module docstring of
        fnt.rollout.environments.episodes).
    score(record, messages) -> float | {name: float}
        The episode's reward; named rewards are summed with the environment's `reward_weights`
        (a name it lacks weighs 1.0) and logged each as reward/{name}/mean.

Episodes advance on their own (rollout.lockstep = false): `respond` and `score` may be called
from several threads at once, for different episodes, never twice at once for one
(rollout.env_concurrency; 1 calls them one at a time). Any method may be `async def`: its
coroutine runs on fnt's one event loop (fnt.rollout.user_code).

A model turn reaches the environment as
    {"role": "assistant", "content": ..., "reasoning": ..., "tool_calls": [...], "text": ...}
read in the format of the model's family (fnt.rollout.environments.parsers; rollout.tool_parser
and rollout.reasoning_parser, "auto": the chat template's): "reasoning" is the thinking ("" when
none), split off first; "tool_calls" are the calls written in the rest ({"type": "function",
"function": {"name", "arguments"}}, a malformed one with an "error" saying why instead), looked
for only when the episode's Start offered tools; "content" is the answer, what remains; "text"
is the whole turn. A call written inside the reasoning is never among the tool_calls, so an
environment that runs `tool_calls` never executes what the model only thought about, and a
reward that reads `content` never credits an answer that appears only in the thinking.
Environments written for the whole turn in "content" read "text" (or set
rollout.reasoning_parser = "none" and rollout.tool_parser = "none").

two optional methods:

    score_turns(record, messages) -> list[float]
        For rollout.credit = "turn": one reward per model turn, in turn order, of the finished
        conversation (what each turn earned on the way: a tool call that worked, progress);
        the episode's `score` is added to the last turn's, and each turn trains on its
        discounted return-to-go against the group's (fnt.rollout.environments.episodes). Never
        called under rollout.credit = "episode", the default;
    prompt_sources(split) -> Sequence[PromptSource]
        For an environment that makes its own prompts (rollout.prompts empty): the prompt
        records of split "train" (what the run samples, the sources mixed by weight as SFT
        mixes data sources, fnt.data.order) or "val" (held-out prompts for val/, never among
        the training ones); the same records every call,

and two optional attributes: `reward_weights` (a mapping, default {}) and
`keep_special_tokens` (default True: a model turn's text keeps its special tokens and drops only
its final stop token, so `cb<|im_start|>a` is not read as "cba" and markers that are special
tokens stay for the parsers; False decodes the turn without special tokens, as rewards saw it
before, for an environment that asks for it).

Environments must be deterministic functions of their arguments: a resumed run replays the
episodes of a step exactly only when the same turns get the same replies.

An environment whose own machinery failed (not the task: a sandbox worker that crashed or timed
out, fnt.rollout.environments.pooled) raises `EnvironmentFailed` from `respond`, `score` or
`score_turns`: the episode ends, is worth the environment's `failure_reward` attribute (default
0.0) and is counted in rollout/env_failures; the run goes on. Any other exception stops the run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

Message = Mapping[str, Any]


class EnvironmentFailed(Exception):
    """The environment could not answer (its worker crashed or timed out): the call's episode
    fails, the run goes on (module docstring)."""


@dataclass(frozen=True)
class Start:
    """How an episode starts: its first messages and the tools the template is given."""

    messages: tuple[Message, ...]
    tools: Optional[tuple[Mapping[str, Any], ...]] = None


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model turn."""

    messages: tuple[Message, ...]
    """The new messages (role "tool" or "user"), rendered after the model's turn."""
    tool_calls: int = 0
    """Tool calls the turn made that were run."""
    tool_errors: int = 0
    """Of those, the ones that failed (a raising tool, a malformed call, an unknown name)."""
    history: Optional[tuple[Message, ...]] = None
    """The conversation rewritten (a summary in place of old turns): the next turn is sampled
    after `history` and then `messages`, rendered anew, in a new training sample of the
    episode; None: the conversation goes on after the model's turn."""


@dataclass(frozen=True)
class PromptSource:
    """Prompt records an environment makes, and their share of the training mixture."""

    name: str
    """How metrics and messages name the source (a reasoning-gym task's name)."""
    records: tuple[Mapping[str, Any], ...]
    """The records `start` and `score` are given, in a fixed order."""
    weight: float = 1.0
    """Relative share of this source's prompts in a step's mixture."""


class Environment(Protocol):
    def start(self, record: Mapping[str, Any]) -> Start: ...

    def respond(
        self, record: Mapping[str, Any], messages: Sequence[Message]
    ) -> Optional[Reply]: ...

    def score(
        self, record: Mapping[str, Any], messages: Sequence[Message]
    ) -> Union[float, Mapping[str, float]]: ...


@dataclass(frozen=True)
class Scored:
    """An episode's reward: the weighted sum, and the named parts it came from (if any)."""

    reward: float
    named: tuple[tuple[str, float], ...] = field(default_factory=tuple)


def weighted_reward(value: Any, weights: Mapping[str, float], who: str, where: str) -> Scored:
    """`score`'s result as a Scored; ValueError naming `who` and `where` when it is neither a
    real number nor a mapping of names to real numbers. NaN/inf pass (rollout.on_bad_reward)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return Scored(float(value))
    if isinstance(value, Mapping) and value:
        named = []
        for name, part in value.items():
            if not isinstance(name, str) or isinstance(part, bool):
                break
            if not isinstance(part, numbers.Real):
                break
            named.append((name, float(part)))
        else:
            total = math.fsum(weights.get(name, 1.0) * part for name, part in named)
            return Scored(total, tuple(named))
    raise ValueError(
        f"{who} returned {value!r} on {where}; expected a float or a non-empty mapping of "
        "names to floats"
    )
