"""RL environments: the protocol (protocol.py), the built-ins (single_turn.py, tools.py,
feedback.py), reasoning-gym's tasks (tasks.py), model turns read per model family (parsers.py),
the token-exact rendering of a conversation's next turn (render.py) and the episodes of a step
run turn by turn (episodes.py), and environments out of the trainer's process (pooled.py,
served.py). Pure, except that `environment_of` imports the module a "module:factory" (or a
"module:function" reward) names and calls the factory (whose errors are the user's:
fnt.rollout.user_code), or starts the worker processes that call it (rollout.isolation), or
asks an environment server for its description.

`rollout.environments` (a list of entries) mixes several by weight (mixture.py).
`rollout.environment = "module:factory"` names a function called once per run as
factory(rollout_config) that returns the environment; empty is the single-turn environment
with rollout.reward; a built-in integration's prefix ("reasoning_gym:TASK") and a server's URL
("http://HOST:PORT", served.py) are built by their entry of fnt.config.environments (`fnt rl
--list-environments`). rollout.isolation.workers > 0 builds the environment in worker
processes instead (pooled.py), which start when it is first built: a process keeps its pools
(`POOLS`), so that the start-up trial, the engine and the held-out evaluation of a run share
one.
"""

from __future__ import annotations

from typing import Any

from fnt.config import RolloutConfig
from fnt.config.environments import environment_kind, out_of_process, require_installed
from fnt.config.references import ENVIRONMENT_SHAPE, import_function, require_function
from fnt.errors import ConfigError, UserCodeError
from fnt.rollout.environments.feedback import FeedbackEnvironment
from fnt.rollout.environments.mixture import MixtureEnvironment, mixture_of
from fnt.rollout.environments.pooled import PooledEnvironment
from fnt.rollout.environments.protocol import (
    Environment,
    EnvironmentFailed,
    PromptSource,
    Reply,
    Start,
)
from fnt.rollout.environments.single_turn import SingleTurnEnvironment
from fnt.rollout.environments.tools import ToolEnvironment, parse_tool_calls, tool_schema
from fnt.rollout.rewards import reward_function
from fnt.rollout.user_code import call_user

__all__ = [
    "Environment",
    "FeedbackEnvironment",
    "MixtureEnvironment",
    "PromptSource",
    "Reply",
    "SingleTurnEnvironment",
    "Start",
    "ToolEnvironment",
    "environment_of",
    "parse_tool_calls",
    "tool_schema",
]


def environment_of(rollout: RolloutConfig) -> tuple[Environment, str]:
    """The environment of a run and the name its errors use: rollout.environment's factory
    called with the rollout config, or the single-turn environment with rollout.reward; with
    rollout.environments, their mixture (fnt.rollout.environments.mixture)."""
    if rollout.environments:
        mixture = mixture_of(rollout, lambda member: environment_of(member)[0])
        if out_of_process(rollout):  # the members' failed calls are worth what isolation says
            mixture.failure_reward = rollout.isolation.failure_reward
        return mixture, f"the environments {list(mixture.names)} (rollout.environments)"
    if not rollout.environment:
        return SingleTurnEnvironment(reward_function(rollout.reward)), f"reward {rollout.reward!r}"
    kind = environment_kind(rollout.environment)
    if rollout.isolation.workers > 0:
        environment = pooled_environment(rollout, kind)
    elif kind.build:
        require_installed(kind, rollout.environment)
        environment = import_function(kind.build, 1)(rollout)
    else:
        factory = require_function(rollout.environment, "rollout.environment", 1, ENVIRONMENT_SHAPE)
        what = f"the environment factory {rollout.environment!r} (rollout.environment) failed"
        environment = call_user(factory, what, rollout)
    missing = [
        m for m in ("start", "respond", "score") if not callable(getattr(environment, m, None))
    ]
    if missing:
        raise ConfigError(
            f"'rollout.environment' = {rollout.environment!r}: the factory returned "
            f"{type(environment).__name__}, which lacks {', '.join(missing)} "
            "(fnt.rollout.environments.protocol)"
        )
    return environment, f"environment {rollout.environment!r}"


POOLS: dict[str, PooledEnvironment] = {}
"""The pools this process started, by the rollout config they were built from (its repr)."""


def pooled_environment(rollout: RolloutConfig, kind: Any) -> Environment:
    """rollout.environment built in rollout.isolation.workers worker processes, under its
    limits (pooled.py); the pool already started for the same rollout config while it is open
    (POOLS), so a run starts its workers once, not once for the start-up trial, once for the
    engine and once for the held-out evaluation. The factory is imported here first, so a wrong
    name is the same one-line ConfigError as in process; a factory that raises or a worker that
    dies while the pool starts is a UserCodeError naming it."""
    started = POOLS.get(repr(rollout))
    if started is not None and not started.closed:
        return started
    if kind.build:
        require_installed(kind, rollout.environment)
        factory = kind.build
    else:
        require_function(rollout.environment, "rollout.environment", 1, ENVIRONMENT_SHAPE)
        factory = rollout.environment
    isolation = rollout.isolation
    try:
        pool = PooledEnvironment(
            factory,
            rollout,
            workers=isolation.workers,
            timeout_s=isolation.timeout_s,
            memory_mb=isolation.memory_mb,
            failure_reward=isolation.failure_reward,
        )
    except (RuntimeError, EnvironmentFailed) as e:
        raise UserCodeError(
            f"the environment {rollout.environment!r} (rollout.environment) did not start in "
            f"its worker processes (rollout.isolation.workers = {isolation.workers}): {e}"
        ) from None
    POOLS[repr(rollout)] = pool
    return pool
