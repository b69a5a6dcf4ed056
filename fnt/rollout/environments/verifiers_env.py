"""verifiers tasksets as fnt environments: `rollout.environment = "verifiers:TASKSET"`. Side
effects: imports the `verifiers` package (the optional extra `fnt[verifiers]`) and the taskset's
module, and runs what the taskset's tools and rewards do (each async one in an event loop of its
own); the rest is pure.

TASKSET names a module that exports one `vf.Taskset` subclass through `__all__`: an installed
taskset package's id (as verifiers loads it: a built-in under verifiers.v1.tasksets, else the
package), or a dotted module path, imported as it is. rollout.environment_args (a JSON object)
sets fields of the taskset's config.

The adapter runs a verifiers taskset with fnt's own engines sampling, so that what trains is
exactly what was sampled, with the sampler's logprobs, in every engine; verifiers' harness
programs, interception server and clients are not used (they would have the model served over
HTTP and re-render conversations themselves). What comes from verifiers:
- the prompts: the taskset's tasks, in `load()` order (a task's system prompt, then its prompt);
- the tools: the `@vf.tool` methods of the task's and the taskset's toolsets, named as verifiers
  advertises them (`{server}_{tool}`), called in this process by fnt's tool environment
  (fnt.rollout.environments.tools) in the format of the model's family (rollout.tool_parser):
  a turn without a call ends the episode;
- the reward: the task's own scoring (`Task.score`: its `@vf.reward` methods and plugged
  rewards, each with its weight) over a verifiers Trace built from the episode's messages, the
  model's turns marked as sampled. Each reward is logged as reward/{name}/mean and the reward
  is their weighted sum, as verifiers' `trace.reward`; `@vf.metric` values are logged the same
  way with weight 0.

Refused with a message naming the taskset: an infinite taskset, an `Env` of its own (several
agents), tasks that need a container, a runtime (setup/finalize hooks, rewards that take
`runtime`), judges or `@vf.stop` hooks. Tool state is verifiers' inert state: a toolset that
keeps per-rollout state in `self.state` is not supported.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from fnt.config import RolloutConfig
from fnt.config.environments import environment_args, environment_kind, require_installed
from fnt.errors import ConfigError
from fnt.rollout.environments.parsers import ToolCall, message_calls
from fnt.rollout.environments.protocol import Message, PromptSource, Reply, Start
from fnt.rollout.environments.tools import TOOL_CALL, ToolEnvironment


def build(rollout: RolloutConfig) -> "VerifiersEnvironment":
    """The environment of `rollout.environment = "verifiers:TASKSET"` (module docstring); its
    ENVIRONMENTS entry's build (fnt.config.environments), also run by preflight."""
    _, _, taskset_id = rollout.environment.partition(":")
    taskset_class, config = verifiers_taskset(taskset_id, environment_args(rollout))
    return VerifiersEnvironment(taskset_class(config), taskset_id)


def import_verifiers(environment: str):
    """The `verifiers.v1` module; a one-line ConfigError naming the extra when it is missing."""
    require_installed(environment_kind("verifiers"), environment)
    import verifiers.v1 as vf

    return vf


def taskset_module(taskset_id: str, where: str):
    """The module of taskset `taskset_id`: a dotted module path imported as it is (verifiers'
    own loader looks for it under verifiers.v1.tasksets, which fails for a dotted path), else
    what verifiers loads by that id (a built-in or an installed package)."""
    vf = import_verifiers(f"verifiers:{taskset_id}")
    try:
        if "." in taskset_id:
            return importlib.import_module(taskset_id)
        return vf.import_taskset(taskset_id)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import the taskset's module: {e}") from None


def exported(module, base: type) -> list[type]:
    """The subclasses of `base` that `module` exports through `__all__` (verifiers' rule)."""
    names = getattr(module, "__all__", ())
    return [
        obj
        for name in names
        if isinstance(obj := getattr(module, name, None), type)
        and issubclass(obj, base)
        and obj is not base
    ]


def verifiers_taskset(taskset_id: str, args: Mapping[str, Any]):
    """The Taskset class of `taskset_id` and its config with fields set from `args`;
    ConfigError when verifiers or the taskset cannot be imported, the module does not export
    exactly one Taskset, exports an Env of its own, or `args` do not fit."""
    where = f"'rollout.environment' = 'verifiers:{taskset_id}'"
    module = taskset_module(taskset_id, where)
    from verifiers.v1 import Env, SingleAgentEnv, Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    classes = exported(module, Taskset)
    if len(classes) != 1:
        raise ConfigError(
            f"{where}: module {module.__name__!r} exports {len(classes)} Taskset subclasses "
            "through __all__; a taskset module exports exactly one"
        )
    if [env for env in exported(module, Env) if env is not SingleAgentEnv]:
        raise ConfigError(
            f"{where}: the taskset brings its own Env (several agents); fnt runs single-agent "
            "tasksets only"
        )
    taskset_class = classes[0]
    config_type = concrete_type(taskset_class, TasksetConfig, origin=Taskset) or TasksetConfig
    try:
        config = config_type(id=taskset_id, **args)
    except Exception as e:  # pydantic's ValidationError lists the bad fields
        raise ConfigError(
            f"{where}: rollout.environment_args do not fit {config_type.__name__}: {e}"
        ) from None
    return taskset_class, config


def _refusals(task, task_type) -> list[str]:
    """What a task needs that the in-process adapter cannot give it."""
    from verifiers.v1 import Task

    found = []
    if task_type.NEEDS_CONTAINER:
        found.append("a container (NEEDS_CONTAINER)")
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(task_type, hook) is not getattr(Task, hook):
            found.append(f"a runtime (it overrides {hook})")
    for fn in (*task.hooks("reward"), *task.hooks("metric")):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            found.append(f"a runtime (its signal {fn.__name__} takes one)")
    if task.config.judges:
        found.append("judges (model calls of their own)")
    if task.hooks("stop"):
        found.append("@vf.stop hooks (fnt's limits are rollout.max_turns and max_episode_tokens)")
    return found


def _sync_tool(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A toolset method as a plain function named `name` with the method's signature and
    docstring (what fnt's tool schema reads); an async method is run to completion."""

    @functools.wraps(method)
    def call(**arguments: Any) -> Any:
        result = method(**arguments)
        return asyncio.run(result) if inspect.isawaitable(result) else result

    call.__name__ = name
    return call


def toolset_functions(toolsets: Sequence[Any]) -> list[Callable[..., Any]]:
    """The `@vf.tool` methods of `toolsets`, each named as verifiers advertises it."""
    from verifiers.v1.utils.decorators import discover_decorated

    functions = []
    for toolset in toolsets:
        server = toolset.server_name
        for method in discover_decorated(toolset, "tool"):
            tool = getattr(method, "tool_name", None) or method.__name__
            functions.append(_sync_tool(method, f"{server}_{tool}" if server else tool))
    return functions


def _content(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content)


def task_messages(data) -> list[dict[str, Any]]:
    """A task's first messages as chat-template dicts: its system prompt, then its prompt."""
    messages = []
    if data.system_prompt is not None:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for message in data.prompt or []:
            if message.role not in ("system", "user", "assistant"):
                raise ValueError(f"a prompt message of role {message.role!r} is not supported")
            messages.append({"role": message.role, "content": _content(message.content)})
    if not messages or messages[-1]["role"] == "assistant":
        raise ValueError("the task's prompt must end with a user or system message")
    return messages


class VerifiersEnvironment:
    """A verifiers taskset's tasks, tools and rewards as an fnt environment (module docstring).
    Records are {"messages": [...], "vf_task": index}; `prompt_sources("train")` gives them."""

    def __init__(self, taskset, taskset_id: str) -> None:
        where = f"'rollout.environment' = 'verifiers:{taskset_id}'"
        if not taskset.bounded:
            raise ConfigError(f"{where}: the taskset is infinite; fnt needs a finite one")
        self.name = taskset_id
        self.tasks = list(taskset)
        if not self.tasks:
            raise ConfigError(f"{where}: the taskset has no tasks")
        task_type = type(taskset).task_type()
        refused = _refusals(self.tasks[0], task_type)
        if refused:
            raise ConfigError(f"{where}: its tasks need {'; '.join(refused)}, not supported")
        toolsets = [
            *task_type.toolsets(taskset.config.task),
            *type(taskset).toolsets(taskset.config),
        ]
        self.tools = ToolEnvironment(toolset_functions(toolsets), reward=None)
        self.schemas = self.tools.schemas or None
        self.reward_weights: dict[str, float] = {}

    def prompt_sources(self, split: str) -> tuple[PromptSource, ...]:
        """ "train": one source, a record per task in the taskset's order. "val": none, since a
        verifiers taskset has no held-out split (its tasks are all one set); validate on
        val.prompts, or on another taskset's prompts by a run of its own."""
        if split == "val":
            return ()
        if split != "train":
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        records = tuple(
            {"messages": task_messages(task.data), "vf_task": i}
            for i, task in enumerate(self.tasks)
        )
        return (PromptSource(self.name, records),)

    def task_of(self, record: Mapping[str, Any]):
        return self.tasks[record["vf_task"]]

    def start(self, record: Mapping[str, Any]) -> Start:
        return Start(tuple(dict(m) for m in record["messages"]), self.schemas)

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        if not self.schemas:
            return None
        return self.tools.respond(record, messages)

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> dict[str, float]:
        """The task's rewards (and metrics, weight 0) on the episode's verifiers Trace."""
        task = self.task_of(record)
        trace = episode_trace(task, messages, len(record["messages"]), self.schemas)
        asyncio.run(task.score(trace))
        unscored = [name for name, reward in trace.rewards.items() if reward is None]
        if unscored:
            raise ValueError(f"rewards {', '.join(unscored)} were not scored")
        if not trace.rewards:
            raise ValueError("the task has no @vf.reward (nothing to score the episode by)")
        named = {}
        for name, reward in trace.rewards.items():
            named[name] = reward.score
            self.reward_weights[name] = reward.weight
        for name, value in trace.metrics.items():
            if name not in named and value is not None:
                named[name] = float(value)
                self.reward_weights[name] = 0.0
        return named


def _assistant(vf, message: Message, turn: int):
    """A model turn as verifiers' AssistantMessage: its content (the answer without reasoning
    or calls, fnt.rollout.environments.parsers) and its well-formed calls as ToolCalls (ids
    call_{turn}_{k}, as the tool messages use)."""
    calls = [
        vf.ToolCall(id=f"call_{turn}_{k}", name=call.name, arguments=json.dumps(call.arguments))
        for k, call in enumerate(message_calls(message))
        if isinstance(call, ToolCall)
    ]
    content = message["content"]
    if "tool_calls" not in message and calls:  # a message with the calls still in its text
        content = TOOL_CALL.sub("", content).strip()
    return vf.AssistantMessage(content=content, tool_calls=calls or None)


def episode_trace(task, messages: Sequence[Message], num_start: int, schemas):
    """A verifiers Trace of an episode: one branch of message nodes, the model's turns (the
    assistant messages after the first `num_start`) marked as sampled."""
    import verifiers.v1 as vf
    from verifiers.v1.state import state_cls

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        state=state_cls(type(task))(),
        tools=[
            vf.Tool(
                name=s["function"]["name"],
                description=s["function"]["description"],
                parameters=s["function"]["parameters"],
            )
            for s in schemas or ()
        ],
    )
    turn, tool_index = 0, 0
    for i, message in enumerate(messages):
        role, text = message["role"], message["content"]
        sampled = role == "assistant" and i >= num_start
        if sampled:
            turn, tool_index = turn + 1, 0
            typed = _assistant(vf, message, turn)
        elif role == "tool":
            typed = vf.ToolMessage(
                tool_call_id=f"call_{turn}_{tool_index}", content=text, name=message.get("name")
            )
            tool_index += 1
        elif role == "assistant":
            typed = vf.AssistantMessage(content=text)
        elif role == "system":
            typed = vf.SystemMessage(content=text)
        else:
            typed = vf.UserMessage(content=text)
        trace.nodes.append(
            vf.MessageNode(parent=i - 1 if i else None, message=typed, sampled=sampled)
        )
    return trace
