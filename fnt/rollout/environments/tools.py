"""The tool environment: plain Python functions as tools, called from the model's turns. Pure,
except for whatever the tool functions themselves do.

Tools: each function's JSON schema (`tool_schema`: its name, the first paragraph of its
docstring, its parameters from the signature's annotations, each described by a
"name: text" line of an "Args:" section when there is one) goes to the chat template's `tools`.

Calls: the turn's `tool_calls`, parsed in the format of the model's family from the answer with
the reasoning taken out (fnt.rollout.environments.parsers: rollout.tool_parser, "auto" from the
chat template), any number per turn; a call written inside the reasoning is never run. A turn
without a call is the model's answer and ends the episode, scored by `reward(content, record)`,
the answer without reasoning or calls. A call that is malformed (bad JSON, an unclosed block),
names no known tool, has arguments the function does not take, or whose function raises becomes
a tool message saying so, and counts as a tool error; the episode goes on. A result that is not
a string is sent as JSON (or its str() when JSON cannot hold it).
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

from fnt.rollout.environments.parsers import ToolCall, message_calls, parse_hermes
from fnt.rollout.environments.protocol import Message, Reply, Start
from fnt.rollout.prompts import prompt_messages

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

JSON_TYPES = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
    tuple: "array",
}


def _json_type(annotation: Any) -> Optional[str]:
    origin = typing.get_origin(annotation) or annotation
    if origin is Union:  # Optional[X]: X's type
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else None
    return JSON_TYPES.get(origin)


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` (or `name (type): text`) lines under an Args:/Arguments: heading."""
    found, inside = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            inside = True
            continue
        if inside:
            if not stripped or (stripped.endswith(":") and " " not in stripped):
                if stripped:
                    inside = False
                continue
            match = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", stripped)
            if match:
                found[match.group(1)] = match.group(2)
    return found


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it ({"type": "function", ...})."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].strip()
    arg_docs = _arg_docs(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop: dict[str, Any] = {}
        kind = _json_type(hints.get(name))
        if kind:
            prop["type"] = kind
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def parse_tool_calls(text: str) -> list[Union[tuple[str, dict[str, Any]], str]]:
    """The Hermes-format calls of a text, in order: (name, arguments) for a well-formed one, an
    error message for a malformed one (bad JSON, no name, arguments not an object, an unclosed
    tag). Other formats: fnt.rollout.environments.parsers.TOOL_PARSERS."""
    return [(c.name, c.arguments) if isinstance(c, ToolCall) else c for c in parse_hermes(text)[1]]


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class ToolEnvironment:
    """The prompt record's messages with `tools` offered; every model turn's tool calls are run
    and answered with tool messages, until a turn calls none (the answer) or a limit ends the
    episode. The score is `reward(answer, record)`, the answer being the last turn's content,
    its reasoning and calls taken out (a float or named rewards, as any environment's)."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        reward: Callable[[str, Mapping[str, Any]], Any],
        *,
        system: Optional[str] = None,
        reward_weights: Optional[Mapping[str, float]] = None,
    ) -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        if len(self.tools) != len(tools):
            raise ValueError("two tools have the same name")
        self.schemas = tuple(tool_schema(fn) for fn in tools)
        self.reward, self.system = reward, system
        self.reward_weights = dict(reward_weights or {})

    def start(self, record: Mapping[str, Any]) -> Start:
        messages = prompt_messages(record)
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        return Start(tuple(messages), self.schemas)

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(the tool message's text, whether it is an error)."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: no tool named {name!r}; the tools are {', '.join(self.tools)}", True
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return f"error: wrong arguments for {name}: {e}", True
        try:
            return _result_text(fn(**arguments)), False
        except Exception as e:  # a tool's failure is a message to the model, never a crash
            return f"error: {name} raised {type(e).__name__}: {e}", True

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        calls = message_calls(messages[-1])
        if not calls:
            return None
        replies, errors = [], 0
        for call in calls:
            if isinstance(call, str):
                name, (text, failed) = "error", (f"error: {call}", True)
            else:
                name, (text, failed) = call.name, self.call(call.name, call.arguments)
            replies.append({"role": "tool", "name": name, "content": text})
            errors += failed
        return Reply(tuple(replies), tool_calls=len(calls), tool_errors=errors)

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Any:
        return self.reward(messages[-1]["content"], record)
