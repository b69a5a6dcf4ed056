"""The RL environments fnt knows by name, one entry each: how rollout.environment names them,
what installs them and whether they bring their own prompts. Pure, apart from `is_installed`
and `require_installed`, which ask the import system whether a package is present (no import).

rollout.environment is routed by its part before the first ":" (`environment_kind`): empty is the
single-turn environment with rollout.reward; a registered prefix ("reasoning_gym", "verifiers",
"http" and "https": an environment server's URL) is that entry, its `build` called as
build(rollout) -> environment; anything else is a user's "module:factory". `fnt rl
--list-environments` prints this table (fnt.apps.environments).

rollout.isolation moves the environment out of the trainer's process (`check_isolation`):
`workers` > 0 runs it in a pool of worker processes (fnt.rollout.environments.pooled), a URL
reaches its server (fnt.rollout.environments.served).

Adding an integration is its implementation's file and one entry here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from fnt.errors import ConfigError

if TYPE_CHECKING:
    from fnt.config.schema import RolloutConfig


@dataclass(frozen=True)
class EnvironmentKind:
    """What fnt knows of an environment (or a kind of them) before it is imported."""

    name: str
    """Its name in the table."""
    spelling: str
    """How rollout.environment names it."""
    summary: str
    """One line for the docs and --list-environments."""
    prefixes: tuple[str, ...] = ()
    """The parts of rollout.environment before ":" that select it (empty: not routed by prefix)."""
    build: str = ""
    """"module:function" called as build(rollout) -> environment (empty: fnt.rollout builds it)."""
    extra: str = ""
    """The pip extra that installs what it needs (pip install 'fnt[EXTRA]'); empty: built in."""
    requires: str = ""
    """The import name of the package the extra installs."""
    distribution: str = ""
    """That package's name on the package index (for its installed version)."""
    names: str = ""
    """"module:function" listing what it can name once installed (reasoning-gym's tasks)."""
    supplies_prompts: bool = False
    """It generates its own prompts (and held-out prompts): rollout.prompts stays empty."""
    check: Optional[Callable[[RolloutConfig], None]] = None
    """ConfigError unless its own keys can run; pure."""
    held_out: Optional[Callable[[RolloutConfig], int]] = None
    """How many held-out prompts (per source) it makes for val/ (None: it makes none)."""
    held_out_key: str = ""
    """The config key that sets `held_out`, for messages."""
    takes_environment_args: bool = False
    """It reads rollout.environment_args (a JSON object of its settings)."""
    runs_user_code: bool = False
    """Built by fnt, it runs the user's code (a server's environment): start-up tries it on the
    first prompt record as it tries a factory's (fnt.apps.preflight.try_user_code)."""


def check_reasoning_gym(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.reasoning_gym's keys name tasks and sizes that can run. Pure."""
    rg = rollout.reasoning_gym
    _, _, task = rollout.environment.partition(":")
    if task and rg.tasks:
        raise ConfigError(
            f"'rollout.environment' = {rollout.environment!r} names a task and "
            "rollout.reasoning_gym.tasks lists tasks: name them in one place (environment = "
            '"reasoning_gym" with the tasks, or "reasoning_gym:TASK" without them)'
        )
    if not task and not rg.tasks:
        raise ConfigError(
            "'rollout.environment' = 'reasoning_gym' needs tasks: "
            '"reasoning_gym:TASK" or rollout.reasoning_gym.tasks = [{name = "TASK"}, ...]'
        )
    for i, spec in enumerate(rg.tasks):
        key = f"rollout.reasoning_gym.tasks[{i}]"
        if not spec.name:
            raise ConfigError(f"'{key}.name' is empty: name a reasoning-gym task")
        if not spec.weight > 0:
            raise ConfigError(f"'{key}.weight' = {spec.weight!r}: must be > 0")
        for param in spec.params:
            if "=" not in param or not param.partition("=")[0].strip():
                raise ConfigError(
                    f'\'{key}.params\' has {param!r}: each is "key=value" (e.g. "max_word_len=6")'
                )
    names = [spec.name for spec in rg.tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"'rollout.reasoning_gym.tasks' names a task twice: {names}")
    if rg.size < 1:
        raise ConfigError(f"'rollout.reasoning_gym.size' = {rg.size}: must be at least 1")
    if rg.val_size < 0:
        raise ConfigError(f"'rollout.reasoning_gym.val_size' = {rg.val_size}: must be >= 0")
    if rollout.prompts:
        raise ConfigError(
            f"'rollout.prompts' = {rollout.prompts!r}: reasoning-gym generates the prompts of "
            f"rollout.environment = {rollout.environment!r}; leave rollout.prompts empty"
        )


def reasoning_gym_val_size(rollout: RolloutConfig) -> int:
    """rollout.reasoning_gym.val_size: held-out prompts per task. Pure."""
    return rollout.reasoning_gym.val_size


def environment_args(rollout: RolloutConfig) -> dict[str, Any]:
    """rollout.environment_args as a dict ({} when empty); ConfigError unless a JSON object."""
    text, key = rollout.environment_args, "rollout.environment_args"
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"'{key}' = {text!r}: not valid JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"'{key}' = {text!r}: must be a JSON object of the taskset's settings")
    return value


def check_verifiers(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.environment names a taskset, rollout.prompts is empty and
    rollout.environment_args is a JSON object. Pure (the taskset is found by preflight/build)."""
    _, _, taskset = rollout.environment.partition(":")
    if not taskset:
        raise ConfigError(
            f"'rollout.environment' = {rollout.environment!r}: name the taskset, "
            '"verifiers:TASKSET" (an installed taskset\'s id or a module path)'
        )
    if rollout.prompts:
        raise ConfigError(
            f"'rollout.prompts' = {rollout.prompts!r}: the verifiers taskset gives the prompts of "
            f"rollout.environment = {rollout.environment!r}; leave rollout.prompts empty"
        )
    environment_args(rollout)


SERVER_COMMAND = "python -m fnt.rollout.environments.served --factory module:factory"
"""How an environment server is started (fnt.rollout.environments.served), for messages."""


def check_served(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.environment is an environment server's URL, http(s)://HOST:PORT
    (a path after it is kept: a proxy's prefix), and rollout.isolation sets no pool of its own:
    the server runs the environment, so its workers and memory limit are the server's. Pure."""
    url = rollout.environment
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number, or out of range
        raise ConfigError(f"'rollout.environment' = {url!r}: not a server's URL ({e})") from None
    if not parts.hostname or parts.query or parts.fragment or port == 0:
        raise ConfigError(
            f"'rollout.environment' = {url!r}: not an environment server's URL; expected "
            f"http://HOST:PORT, the address of {SERVER_COMMAND} --port PORT"
        )
    isolation = rollout.isolation
    for key, flag in (("workers", "--workers"), ("memory_mb", "--memory-mb")):
        value = getattr(isolation, key)
        if value:
            raise ConfigError(
                f"'rollout.isolation.{key}' = {value!r}: rollout.environment = {url!r} is served, "
                f"so its server runs it: give the server {flag} ({SERVER_COMMAND} {flag} ...) "
                f"and leave rollout.isolation.{key} at 0"
            )


ENVIRONMENTS: tuple[EnvironmentKind, ...] = (
    EnvironmentKind(
        name="single_turn",
        spelling='"" (empty), with rollout.reward',
        summary="one model turn per prompt of rollout.prompts, scored by rollout.reward",
    ),
    EnvironmentKind(
        name="factory",
        spelling='"module:factory"',
        summary="your function factory(rollout) -> environment (fnt.rollout.environments: "
        "ToolEnvironment, FeedbackEnvironment or your own class), on rollout.prompts",
    ),
    EnvironmentKind(
        name="reasoning_gym",
        spelling='"reasoning_gym:TASK", or "reasoning_gym" with rollout.reasoning_gym.tasks',
        summary="reasoning-gym's seeded task generators make the prompts (train and held-out) "
        "and its scorers the rewards",
        prefixes=("reasoning_gym",),
        build="fnt.rollout.environments.tasks:build",
        extra="tasks",
        requires="reasoning_gym",
        distribution="reasoning-gym",
        names="fnt.rollout.environments.tasks:task_names",
        supplies_prompts=True,
        check=check_reasoning_gym,
        held_out=reasoning_gym_val_size,
        held_out_key="rollout.reasoning_gym.val_size",
    ),
    EnvironmentKind(
        name="verifiers",
        spelling='"verifiers:TASKSET", with rollout.environment_args',
        summary="a verifiers taskset's tasks (the prompts; no held-out split), tools and rubric "
        "(the rewards), run by fnt's engines",
        prefixes=("verifiers",),
        build="fnt.rollout.environments.verifiers_env:build",
        extra="verifiers",
        requires="verifiers",
        distribution="verifiers",
        supplies_prompts=True,
        check=check_verifiers,
        takes_environment_args=True,
    ),
    EnvironmentKind(
        name="served",
        spelling='"http://HOST:PORT", its server started with ' + SERVER_COMMAND,
        summary="an environment behind HTTP, run by its server in another process, container or "
        "machine (a crash or hang there costs only the episode), on rollout.prompts",
        prefixes=("http", "https"),
        build="fnt.rollout.environments.served:build",
        check=check_served,
        runs_user_code=True,
    ),
)
"""The environments fnt knows, in the order --list-environments shows them."""


def environment_kind(environment: str) -> EnvironmentKind:
    """The entry rollout.environment = `environment` is routed to (module docstring)."""
    by_name = {kind.name: kind for kind in ENVIRONMENTS}
    if not environment:
        return by_name["single_turn"]
    prefix = environment.partition(":")[0]
    for kind in ENVIRONMENTS:
        if prefix in kind.prefixes:
            return kind
    return by_name["factory"]


def out_of_process(rollout: RolloutConfig) -> bool:
    """Whether a call of the run's environment (or of a member of its mixture) can fail without
    failing the run: it runs in worker processes (rollout.isolation.workers) or is served. Pure."""
    if rollout.isolation.workers > 0:
        return True
    names = [entry.environment for entry in rollout.environments] or [rollout.environment]
    return any(environment_kind(name).name == "served" for name in names)


def check_isolation(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.isolation's keys can run: workers >= 0 with an environment to
    run (rollout.environment or rollout.environments), timeout_s > 0, memory_mb >= 0, a finite
    failure_reward, and no limit set for an environment that runs in the trainer's process,
    where nothing would apply it. Pure."""
    isolation = rollout.isolation

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            value = getattr(isolation, key)
            raise ConfigError(f"'rollout.isolation.{key}' = {value!r}: {message}")

    require(isolation.workers >= 0, "workers", "must be >= 0 (0: in the trainer's process)")
    require(
        isolation.workers == 0 or bool(rollout.environment or rollout.environments),
        "workers",
        "runs rollout.environment in worker processes, and none is set (rollout.reward alone "
        'scores in the trainer\'s process): set rollout.environment = "module:factory"',
    )
    require(
        math.isfinite(isolation.timeout_s) and isolation.timeout_s > 0, "timeout_s", "must be > 0"
    )
    require(isolation.memory_mb >= 0, "memory_mb", "must be >= 0 (0: no limit)")
    require(math.isfinite(isolation.failure_reward), "failure_reward", "must be a finite number")
    if out_of_process(rollout):
        return
    defaults = type(isolation)()
    for key in ("memory_mb", "timeout_s", "failure_reward"):
        require(
            getattr(isolation, key) == getattr(defaults, key),
            key,
            "applies to an environment out of the trainer's process, and this one runs in it: "
            'set rollout.isolation.workers, or serve it (rollout.environment = "http://HOST:PORT")',
        )


def supplies_prompts(rollout: RolloutConfig) -> bool:
    """Whether the run's prompts come from its environment rather than rollout.prompts (a
    mixture's always do: each member's own, or its entry's `prompts`). Pure."""
    return bool(rollout.environments) or environment_kind(rollout.environment).supplies_prompts


def has_prompts(rollout: RolloutConfig) -> bool:
    """Whether a run samples prompts at all: rollout.prompts, or an environment's own. Pure."""
    return bool(rollout.prompts) or supplies_prompts(rollout)


def environment_val_size(rollout: RolloutConfig) -> int:
    """Held-out prompts per source the run's environment makes for val/ (0: none); a mixture's
    most of any member's, an entry's val_prompts file counting as 1 (its size is known once it
    is read). Pure."""
    if rollout.environments:
        return max(
            max(environment_val_size(member_rollout(rollout, entry)), int(bool(entry.val_prompts)))
            for entry in rollout.environments
        )
    kind = environment_kind(rollout.environment)
    return kind.held_out(rollout) if kind.held_out is not None else 0


MIXTURE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What a mixture member's name may be made of: it is part of metric keys and file records."""


def member_rollout(rollout: RolloutConfig, entry: Any) -> RolloutConfig:
    """The rollout config a mixture member (an entry of rollout.environments) is checked and
    built with: the run's, with the entry's environment, environment_args and prompts. Pure."""
    return dataclasses.replace(
        rollout,
        environment=entry.environment,
        environment_args=entry.environment_args,
        prompts=entry.prompts,
        environments=(),
    )


def check_mixture(rollout: RolloutConfig) -> None:
    """ConfigError unless rollout.environments is a mixture that can run: unique names made of
    letters, digits, "_", "." and "-"; each entry an environment with weight > 0, and a
    built-in that makes its own prompts without the entry's `prompts` (a "module:factory"
    without them must make its own: fnt.rollout.environments.mixture checks it built); no
    rollout.environment, rollout.environment_args or rollout.prompts beside it. Pure."""
    for key in ("environment", "environment_args", "prompts"):
        value = getattr(rollout, key)
        if value:
            raise ConfigError(
                f"'rollout.{key}' = {value!r}: rollout.environments is set, so each of its "
                f"entries names its own {key}; leave rollout.{key} empty"
            )
    names = [entry.name for entry in rollout.environments]
    for i, entry in enumerate(rollout.environments):
        key = f"rollout.environments[{i}]"
        if not MIXTURE_NAME.fullmatch(entry.name):
            raise ConfigError(
                f"'{key}.name' = {entry.name!r}: name each environment with letters, digits, "
                '"_", "." and "-" (it is part of metric keys: rollout/{name}/reward)'
            )
        if names.count(entry.name) > 1:
            raise ConfigError(f"'rollout.environments' names {entry.name!r} twice: {names}")
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(f"'{key}.weight' = {entry.weight!r}: must be a finite number > 0")
        kind = environment_kind(entry.environment)
        if kind.name == "single_turn":
            raise ConfigError(
                f"'{key}.environment' is empty: name the environment, \"module:factory\" or a "
                'built-in one such as "reasoning_gym:TASK" (fnt rl --list-environments)'
            )
        module, colon, factory = entry.environment.partition(":")
        if kind.name == "factory" and not (module and colon and factory):
            raise ConfigError(
                f"'{key}.environment' = {entry.environment!r}: must be \"module:factory\" or a "
                'built-in one such as "reasoning_gym:TASK" (fnt rl --list-environments)'
            )
        if entry.environment_args and not kind.takes_environment_args:
            raise ConfigError(
                f"'{key}.environment_args' = {entry.environment_args!r}: is read only by an "
                "environment that takes settings: "
                + ", ".join(k.spelling for k in ENVIRONMENTS if k.takes_environment_args)
            )
        if kind.supplies_prompts and entry.prompts:
            raise ConfigError(
                f"'{key}.prompts' = {entry.prompts!r}: {entry.environment!r} makes its own "
                "prompts; leave the entry's prompts empty"
            )
        if kind.supplies_prompts and entry.val_prompts:
            raise ConfigError(
                f"'{key}.val_prompts' = {entry.val_prompts!r}: {entry.environment!r} makes its "
                "own prompts (held-out ones too, where it has them); leave it empty"
            )
        if kind.check is not None:
            try:
                kind.check(member_rollout(rollout, entry))
            except ConfigError as e:
                raise ConfigError(f"{key} ({entry.name}): {e}") from None


def is_installed(kind: EnvironmentKind) -> bool:
    """Whether what `kind` needs is importable (always, for a built-in one)."""
    return not kind.requires or importlib.util.find_spec(kind.requires) is not None


def require_installed(kind: EnvironmentKind, environment: str) -> None:
    """ConfigError (one line, naming the extra) unless the package `kind` needs is installed."""
    if not is_installed(kind):
        raise ConfigError(
            f"'rollout.environment' = {environment!r} needs the {kind.requires} package, which is "
            f"not installed: pip install 'fnt[{kind.extra}]'"
        )
