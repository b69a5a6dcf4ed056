"""The training modes, one entry each (SFT, RL, DPO): everything validation, preflight, the
builder, evaluation and the command line need to know of a mode, without importing its parts.
Pure, except that a mode's `check` resolves the "module:function" a custom loss names (importing
its module): an entry names its implementations as "module:attribute", imported only by a run of
that mode; its step function ("steps:...") only by the `fnt` command, as the library never
imports the steps package.

A config is of the mode whose config class comes first in its class's MRO (`mode_of`), so a
config class of your own derived from RLConfig is an RL run, as it is for `isinstance`.

Adding a mode is its parts (a config class with its sections in fnt/config/schema.py, a step
function in steps/, a batch source, the builder of its handles, the loader of its held-out data,
its preflight) and one entry here, with the checks of its own sections beside it; the `fnt`
command names it in COMMANDS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fnt.config.engines import ENGINES, engine_of
from fnt.config.environments import (
    ENVIRONMENTS,
    check_isolation,
    check_mixture,
    environment_kind,
    environment_val_size,
    has_prompts,
)
from fnt.config.losses import check_preference_loss, check_rl_loss, preference_loss
from fnt.config.schema import Config, DPOConfig, RLConfig, RolloutConfig
from fnt.errors import ConfigError


def no_reference(config: Config) -> str:
    """A mode without a reference policy. Pure."""
    return ""


@dataclass(frozen=True)
class Mode:
    """What fnt knows of a training mode before any of its parts is imported."""

    config: type
    """Its config class: what `fnt COMMAND` parses the command line into."""
    summary: str
    """One line for the docs: what a step trains on."""
    step: str
    """"module:function" of its step function, step(state, batch) -> (state, metrics); the
    `fnt` command passes it to the driver (the library never imports it)."""
    source: str
    """"module:function" of its batch source, source(state) -> batch (fnt.sources)."""
    handles: str
    """"module:function" building what its source reads, handles(config, runtime, announce) ->
    {handle name: component} (the state's `data` or `rollouts`; fnt.build)."""
    eval_data: str
    """"module:function" loading its held-out data, eval_data(config) -> the state's `val`
    handle, called when the config has any (fnt.evaluation)."""
    preflight: str
    """"module:function" of the first-glance checks of its data and prompts, fn(config), before
    any model is built (fnt.apps.preflight)."""
    check: Optional[Callable[[Any, int], None]] = None
    """ConfigError unless its own sections can run on this many data-parallel ranks; pure and
    torch-free like all validation (it may resolve a "module:function" a key names)."""
    rollouts: bool = False
    """Its batches are rollouts of the engine rollout.engine names (fnt.config.engines): the
    config has `rollout` and `loss` sections, and greedy evaluation of held-out prompts and
    saved samples apply."""
    reference: Callable[[Any], str] = no_reference
    """Where a config's reference logprobs come from: "model" (a frozen reference policy
    init_state builds), "precomputed" (a table computed once before step 1), "rollouts" (the
    samples carry them) or "" (none are read). Pure."""
    reference_key: str = ""
    """The config key naming the reference policy's directory (empty value: model.name)."""
    epochs_refused: str = ""
    """Why max_epochs does not apply to it ("": it counts passes over data.sources)."""


def rl_reference(config: RLConfig) -> str:
    """Where an RL run's reference logprobs come from: loss.ref_source ("model" or "rollouts")
    with the reference KL on, else "". Pure."""
    loss = config.loss
    return loss.ref_source if loss.ref_kl_tau else ""


def dpo_reference(config: DPOConfig) -> str:
    """Where a DPO run's reference logprobs come from: nowhere ("") for a reference-free loss
    (fnt.config.losses), else "precomputed" with dpo.precompute_reference, "model" without.
    Pure."""
    dpo = config.dpo
    if preference_loss(dpo.loss).reference_free:
        return ""
    return "precomputed" if dpo.precompute_reference else "model"


def check_rl(config: RLConfig, dp: int) -> None:
    """ConfigError unless an RL run's loss and rollout sections can run on `dp` data-parallel
    ranks: the loss (fnt.config.losses), then the engine's settings (its own check, and the
    sampling settings of an engine that samples rollout.prompts). Resolves loss.custom."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'{key}' = {value_at(config, key)!r}: {message}")

    rollout, loss = config.rollout, config.loss
    require(rollout.timeout_s > 0, "rollout.timeout_s", "must be > 0")
    require(rollout.keep_weights >= 1, "rollout.keep_weights", "must be at least 1")
    check_rl_loss(loss)
    require(
        loss.ref_source == "model" or engine_of(rollout).ref_logprobs,
        "loss.ref_source",
        f"only the {' or '.join(n for n, e in ENGINES.items() if e.ref_logprobs)} engine's "
        f'samples carry ref_logprobs; use "model" with the {rollout.engine} engine',
    )
    require(
        rollout.publish != "adapter" or config.model.lora.rank > 0,
        "rollout.publish",
        'publishes LoRA adapters, but model.lora.rank = 0: set a rank, or use "auto"',
    )
    require(rollout.async_level >= 0, "rollout.async_level", "must be >= 0")
    require(
        rollout.credit == "episode" or engine_of(rollout).samples_prompts,
        "rollout.credit",
        f"the {rollout.engine} engine's samples come with their advantages; per-turn credit "
        "needs an engine that runs the episodes ("
        + ", ".join(name for name, e in ENGINES.items() if e.samples_prompts)
        + ")",
    )
    require(
        not rollout.environments or engine_of(rollout).samples_prompts,
        "rollout.environments",
        f"the {rollout.engine} engine's samples come from outside, so no environment runs them; "
        "a mixture needs an engine that runs the episodes ("
        + ", ".join(name for name, e in ENGINES.items() if e.samples_prompts)
        + ")",
    )
    check_filter_groups(rollout)
    engine = engine_of(rollout)
    if engine.samples_prompts:
        validate_rollout(rollout, dp_size=dp)
    if engine.check is not None:
        engine.check(rollout)


def check_filter_groups(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.filter_groups can run with the engine and async_level. Pure.

    A filtering step knows where its prompts end only once its groups are scored, so the next
    step's prompts are not known ahead: async rollouts (which start later steps early) and
    engines that do not sample the prompts themselves cannot filter."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'rollout.{key}' = {getattr(rollout, key)!r}: {message}")

    require(rollout.filter_max_rounds >= 2, "filter_max_rounds", "must be at least 2")
    if not rollout.filter_groups:
        return
    filtering = [name for name, engine in ENGINES.items() if engine.filters_groups]
    require(
        engine_of(rollout).filters_groups,
        "filter_groups",
        f"the {rollout.engine} engine cannot filter groups (only {', '.join(filtering)} can): "
        "turn it off, or use that engine",
    )
    require(
        rollout.async_level == 0,
        "filter_groups",
        f"needs rollout.async_level = 0 (it is {rollout.async_level}): a filtering step's last "
        "prompt is known only once its groups are scored, so later steps cannot start early",
    )
    require(
        rollout.group_size >= 2,
        "filter_groups",
        "needs rollout.group_size >= 2: a group of one completion has no other to differ from "
        "(its advantage is always 0), so every group would be filtered",
    )


def check_dpo(config: DPOConfig, dp: int) -> None:
    """ConfigError unless a DPO run's data and dpo section can run; resolves dpo.custom."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'{key}' = {value_at(config, key)!r}: {message}")

    data = config.data
    require(data.kind == "sources", "data.kind", 'fnt dpo trains on pairs: use "sources"')
    require(
        tuple(data.loss_mask) == ("assistant",),
        "data.loss_mask",
        'fnt dpo trains each pair\'s response turn only; leave it at ["assistant"]',
    )
    require(
        data.train_turns == "all",
        "data.train_turns",
        'fnt dpo trains each pair\'s response turn only; leave it at "all"',
    )
    check_preference_loss(config.dpo)


MODES: dict[str, Mode] = {
    "sft": Mode(
        config=Config,
        summary="supervised fine-tuning on the chats of data.sources (or synthetic rows)",
        step="steps:sft_step",
        source="fnt.sources:sft_source",
        handles="fnt.build:sample_handles",
        eval_data="fnt.evaluation.held_out:load_eval_data",
        preflight="fnt.apps.preflight:check_sample_data",
    ),
    "rl": Mode(
        config=RLConfig,
        summary="reinforcement learning on rollouts of the engine rollout.engine names",
        step="steps:rl_step",
        source="fnt.sources:rl_source",
        handles="fnt.build:rollout_handles",
        eval_data="fnt.evaluation.held_out:load_eval_data",
        preflight="fnt.apps.preflight:check_rollout_data",
        check=check_rl,
        rollouts=True,
        reference=rl_reference,
        reference_key="loss.ref_model",
        epochs_refused="an RL run draws prompts endlessly and counts steps",
    ),
    "dpo": Mode(
        config=DPOConfig,
        summary="preference optimization on the pairs of data.sources",
        step="steps:dpo_step",
        source="fnt.sources:pair_source",
        handles="fnt.build:pair_handles",
        eval_data="fnt.evaluation.pairs:load_pair_eval_data",
        preflight="fnt.apps.preflight:check_pair_data",
        check=check_dpo,
        reference=dpo_reference,
        reference_key="dpo.ref_model",
    ),
}
"""The training modes by the name of their `fnt` command."""


def mode_of(config: Config) -> Mode:
    """The entry of the mode whose config class comes first in the MRO of the config's class;
    TypeError for an object no mode's class is a base of."""
    by_class = {mode.config: mode for mode in MODES.values()}
    for cls in type(config).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise TypeError(
        f"{type(config).__name__} is no mode's config: the modes' classes are "
        + ", ".join(mode.config.__name__ for mode in MODES.values())
    )


def value_at(config: Any, key: str) -> Any:
    """The value of the dotted config key `key` ("loss.ref_model"). Pure."""
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def reference_dir(config: Config) -> str:
    """The directory of the reference policy the config names (its mode's reference_key), ""
    when it names none (model.name, or with LoRA its base, is the reference then). Pure."""
    key = mode_of(config).reference_key
    return value_at(config, key) if key else ""


def held_out_prompts(config: Config) -> int:
    """How many held-out prompts (per source) the run's environment makes for val/: in a mode
    whose batches are rollouts, rollout.environment's; else 0. Pure."""
    return environment_val_size(config.rollout) if mode_of(config).rollouts else 0


def has_val_data(config: Config) -> bool:
    """Whether the val section (or the environment) gives held-out data: val.sources,
    val.prompts or an environment's held-out prompts. Pure."""
    val = config.val
    return bool(val.sources or val.prompts or held_out_prompts(config) > 0)


def validate_rollout(rollout: RolloutConfig, *, dp_size: int) -> None:
    """ConfigError unless the in-process engine's settings can run on dp_size ranks. Pure."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'rollout.{key}' = {getattr(rollout, key)!r}: {message}")

    if rollout.environments:
        check_mixture(rollout)
    check_isolation(rollout)
    kind = environment_kind(rollout.environment)
    if kind.check is not None:
        kind.check(rollout)
    require(has_prompts(rollout), "prompts", "name a JSONL file of prompts")
    require(
        not rollout.environment_args or kind.takes_environment_args,
        "environment_args",
        "is read only by an environment that takes settings: "
        + ", ".join(k.spelling for k in ENVIRONMENTS if k.takes_environment_args),
    )
    require(
        bool(rollout.reward or rollout.environment or rollout.environments),
        "reward",
        'name a reward (see fnt.rollout.rewards) or "module:function", or set rollout.environment',
    )
    if kind.name == "factory":
        module, colon, factory = rollout.environment.partition(":")
        require(
            bool(module and colon and factory),
            "environment",
            'must be "module:factory", a function returning an environment '
            '(fnt.rollout.environments), or a built-in one such as "reasoning_gym:TASK" '
            "(fnt rl --list-environments)",
        )
    require(rollout.max_turns >= 1, "max_turns", "must be at least 1")
    require(rollout.env_concurrency >= 1, "env_concurrency", "must be at least 1")
    require(
        rollout.credit == "episode" or bool(rollout.environment or rollout.environments),
        "credit",
        '"turn" needs rollout.environment, one whose score_turns rewards each model turn '
        "(docs/environments.md); rollout.reward scores whole completions only",
    )
    require(
        math.isfinite(rollout.turn_discount) and 0 < rollout.turn_discount <= 1,
        "turn_discount",
        "must be in (0, 1]",
    )
    require(rollout.max_episode_tokens >= 0, "max_episode_tokens", "must be >= 0 (0: seq_len)")
    require(rollout.prompts_per_step >= 1, "prompts_per_step", "must be at least 1")
    require(
        rollout.prompts_per_step % dp_size == 0,
        "prompts_per_step",
        f"must be divisible by the data-parallel size ({dp_size}): each rank takes an equal share",
    )
    require(rollout.group_size >= 1, "group_size", "must be at least 1")
    require(rollout.max_new_tokens >= 1, "max_new_tokens", "must be at least 1")
    require(
        math.isfinite(rollout.temperature) and rollout.temperature > 0,
        "temperature",
        "must be a finite number > 0",
    )
