"""Environment mixtures (rollout.environments): several environments in one run, each step's
prompts drawn by weight. Side effects: building one imports and calls each member's factory
(fnt.rollout.environments.environment_of) and reads the JSONL files of an entry's `prompts`
and `val_prompts` (its held-out prompts, validated per member: fnt.evaluation.held_out);
the environment's methods are pure dispatch.

A mixture is itself an environment (fnt.rollout.environments.protocol) that makes its own
prompts: its prompt sources are each member's sources (a member given an entry's `prompts` has
one, the file's records), every record wrapped as {"environment": name, "record": record}, so
the run's one prompt order (fnt.rollout.prompts.prompt_order, fnt.data.order) mixes them like
any environment's sources. A source's weight is its entry's weight times the source's share of
its member's own weights, so a member's prompts take `weight / sum(weights)` of the draws
whatever its sources, and inside it they mix as they would alone. `start`, `respond`, `score`
and `score_turns` unwrap a record and call its member. A member's named rewards are renamed
"{name}/{reward}" (their weights with them), so two members may use the same reward name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fnt.config import RolloutConfig
from fnt.config.environments import member_rollout, supplies_prompts
from fnt.errors import ConfigError
from fnt.rollout.environments.protocol import PromptSource, Start
from fnt.store.jsonl import jsonl_records

ENVIRONMENT_KEY = "environment"
"""The key of a mixture record naming its member (what saved samples and metrics call it)."""


def tagged(name: str, record: Any) -> dict[str, Any]:
    """A member's prompt record as the mixture's. Pure."""
    return {ENVIRONMENT_KEY: name, "record": record}


def member_name(record: Mapping[str, Any]) -> str:
    """The name of the member whose prompt a mixture record is. Pure."""
    return record[ENVIRONMENT_KEY]


class MixtureEnvironment:
    """Several environments behind one (module docstring)."""

    def __init__(
        self,
        members: Sequence[tuple[str, Any]],
        weights: Sequence[float],
        prompt_files: Sequence[str],
        *,
        turn_credit: bool = False,
        val_prompt_files: Sequence[str] = (),
    ) -> None:
        """`members` are (name, environment) pairs in config order, each with its entry's
        weight, prompts file (empty: the member makes its own) and held-out prompts file
        (`val_prompt_files`; empty or absent: the member's own held-out prompts, if any)."""
        self.names = tuple(name for name, _ in members)
        self.members = dict(members)
        self.weights = dict(zip(self.names, weights))
        self.prompt_files = dict(zip(self.names, prompt_files))
        self.val_prompt_files = dict(zip(self.names, val_prompt_files))
        keep = {getattr(env, "keep_special_tokens", True) for env in self.members.values()}
        if len(keep) > 1:
            raise ConfigError(
                "'rollout.environments': the environments disagree on keep_special_tokens "
                "(how a model turn is decoded for them); a mixture decodes turns one way"
            )
        self.keep_special_tokens = keep.pop()
        self.reward_weights = {
            f"{name}/{reward}": weight
            for name, env in members
            for reward, weight in (getattr(env, "reward_weights", None) or {}).items()
        }
        lacking = [n for n, env in members if not callable(getattr(env, "score_turns", None))]
        if turn_credit and lacking:
            raise ConfigError(
                f"'rollout.credit' = 'turn': the environments {lacking} of rollout.environments "
                "do not score turns (score_turns, fnt.rollout.environments.protocol); every "
                'member must, or use rollout.credit = "episode"'
            )
        if not lacking:
            self.score_turns = self.member_score_turns

    def member(self, record: Mapping[str, Any]) -> tuple[str, Any, Any]:
        """The name and environment of a mixture record's member, and its own record."""
        name = member_name(record)
        return name, self.members[name], record["record"]

    def start(self, record: Mapping[str, Any]) -> Start:
        _, environment, own = self.member(record)
        return environment.start(own)

    def respond(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        _, environment, own = self.member(record)
        return environment.respond(own, messages)

    def score(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        name, environment, own = self.member(record)
        score = environment.score(own, messages)
        if isinstance(score, Mapping):
            return {f"{name}/{reward}": value for reward, value in score.items()}
        return score

    def member_score_turns(
        self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        _, environment, own = self.member(record)
        return environment.score_turns(own, messages)

    def prompt_sources(self, split: str) -> tuple[PromptSource, ...]:
        """Every member's sources of `split`, records tagged, weights per the module docstring;
        a member with a prompts file has one "train" source of its records and no "val" one."""
        sources = []
        for name in self.names:
            own = self.member_sources(name, split)
            total = sum(float(source.weight) for source in own)
            for source in own:
                share = float(source.weight) / total if total > 0 else 0.0
                sources.append(
                    PromptSource(
                        name=f"{name}/{source.name}",
                        records=tuple(tagged(name, r) for r in source.records),
                        weight=self.weights[name] * share,
                    )
                )
        return tuple(sources)

    def member_sources(self, name: str, split: str) -> tuple[PromptSource, ...]:
        """A member's own prompt sources of `split`: its entry's prompts file's ("train") and
        val_prompts file's ("val") records, where it has them, else its environment's."""
        val_path = self.val_prompt_files.get(name, "")
        if split == "val" and val_path:
            where = f"the val_prompts file {val_path} (rollout.environments entry {name!r})"
            records = tuple(record for _, record in jsonl_records(val_path, where))
            return (PromptSource(name="val_prompts", records=records),)
        path = self.prompt_files[name]
        if path:
            if split != "train":
                return ()
            where = f"the prompts file {path} (rollout.environments entry {name!r})"
            records = tuple(record for _, record in jsonl_records(path, where))
            return (PromptSource(name="prompts", records=records),)
        environment = self.members[name]
        if not callable(getattr(environment, "prompt_sources", None)):
            raise ConfigError(
                f"'rollout.environments' entry {name!r}: its environment makes no prompts "
                "(no prompt_sources); name a JSONL file in the entry's prompts"
            )
        return tuple(environment.prompt_sources(split))


def mixture_of(rollout: RolloutConfig, build: Any) -> MixtureEnvironment:
    """The mixture of rollout.environments, each member built by `build(member_rollout)` (the
    run's rollout config with the entry's environment, environment_args and prompts)."""
    members, prompt_files = [], []
    for entry in rollout.environments:
        member = member_rollout(rollout, entry)
        members.append((entry.name, build(member)))
        prompt_files.append("" if supplies_prompts(member) else entry.prompts)
    return MixtureEnvironment(
        members,
        [entry.weight for entry in rollout.environments],
        prompt_files,
        turn_credit=rollout.credit == "turn",
        val_prompt_files=[entry.val_prompts for entry in rollout.environments],
    )
