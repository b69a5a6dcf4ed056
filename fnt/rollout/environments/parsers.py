"""A model turn as environments read it: its reasoning, its answer and its tool calls apart, in the
format of the model's family. Pure.

Reasoning is split off first, and tool calls are looked for in the answer only: a call written
inside the reasoning is thought, not action, and is never run (a model that "considers" a call
in its thinking and then answers must not have the call executed and the episode go on).

Reasoning parsers (rollout.reasoning_parser):
- "think": `<think>...</think>` blocks (Qwen3, QwQ, DeepSeek-R1 and its distills, GLM-4.5).
  When the prompt already opened the block (templates that end the generation prompt with
  `<think>`, so the completion starts inside it) or the turn closes a block it never opened,
  the text up to the first `</think>` is reasoning. A block never closed (the turn stopped or
  was cut while thinking) is reasoning to the end: an unfinished thought is not an answer.
- "none": no reasoning; the whole turn is the answer.

Tool parsers (rollout.tool_parser), each the format its family's chat template asks for:
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes).
- "qwen3_coder": `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>` (Qwen3-Coder).
- "llama3_json": a turn that is a JSON object `{"name": ..., "parameters": {...}}` (or
  "arguments"), possibly after `<|python_tag|>`, several separated by ";" (Llama 3.1-3.3).
- "mistral": `[TOOL_CALLS]` followed by a JSON list of {"name", "arguments"} (Mistral 7B v0.3,
  Nemo, Small 3.1) or by `NAME[ARGS]{...}` once per call (the v11+ tokenizers: Small 3.2,
  Magistral, Devstral, Ministral 3).
- "deepseek_v3": `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the
  arguments in a ```json block, `<｜tool▁call▁end｜>` per call (DeepSeek-V3, R1-0528); V3.1's
  `NAME<｜tool▁sep｜>{...}` too.
- "glm45": `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`
  (GLM-4.5, 4.6).
- "none": no tool calls; the answer is all content.
The XML formats write a string argument as it is and any other value as JSON: a value is read
as the type the tool's schema declares (a string stays a string; otherwise JSON, or the string
when it is not JSON).

"auto" (the default of both) is the family the chat template names (`detect_tool_parser`,
`detect_reasoning_parser`); a template that names none gets "hermes" and "none", what fnt
parsed before the families.

A malformed call (bad JSON, no name, arguments that are not an object, an unclosed block) is
kept in its place among the calls as an error message, so the environment can answer it; the
answer text is what remains once the reasoning and every call are taken out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


Call = Union[ToolCall, str]
"""A call as parsed: a ToolCall, or the message saying why it is malformed."""

Schemas = Optional[Sequence[Mapping[str, Any]]]
"""The tools' JSON schemas as the template got them (Start.tools)."""


# ---------------------------------------------------------------------------------------------
# Reasoning


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_think(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a turn that thinks in <think> blocks (module docstring); `opened`:
    the prompt ended inside an open block. Without any block the answer is the text as it is."""
    inside = opened
    if not inside:  # a close before any open: the block was opened by the prompt
        close, open_ = text.find(THINK_CLOSE), text.find(THINK_OPEN)
        inside = close != -1 and (open_ == -1 or close < open_)
    if not inside and THINK_OPEN not in text:
        return "", text
    thoughts, answer, rest = [], [], text
    while rest:
        if inside:
            end = rest.find(THINK_CLOSE)
            if end == -1:
                thoughts.append(rest)
                break
            thoughts.append(rest[:end])
            rest, inside = rest[end + len(THINK_CLOSE) :], False
        else:
            start = rest.find(THINK_OPEN)
            if start == -1:
                answer.append(rest)
                break
            answer.append(rest[:start])
            rest, inside = rest[start + len(THINK_OPEN) :], True
    return "\n\n".join(t.strip() for t in thoughts if t.strip()), "".join(answer).strip()


def split_none(text: str, opened: bool = False) -> tuple[str, str]:
    """No reasoning: the whole turn is the answer."""
    return "", text


REASONING_PARSERS: dict[str, Callable[[str, bool], tuple[str, str]]] = {
    "think": split_think,
    "none": split_none,
}


def opens_reasoning(prompt_tail: str, reasoning_parser: str) -> bool:
    """Whether the text before a turn (the end of its context) leaves a reasoning block open, so
    that the turn starts inside it (a template whose generation prompt ends with <think>)."""
    if reasoning_parser != "think":
        return False
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


# ---------------------------------------------------------------------------------------------
# Tool calls: each parser maps the answer to (the answer without its calls, the calls).


def _declared_types(schemas: Schemas) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: its JSON type}} from the tools' schemas."""
    types: dict[str, dict[str, str]] = {}
    for schema in schemas or ():
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {
            key: prop.get("type", "") for key, prop in properties.items() if isinstance(prop, dict)
        }
    return types


def _typed(value: str, declared: str) -> Any:
    """An XML-format argument as the type its schema declares (module docstring)."""
    if declared == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _short(text: str) -> str:
    return repr(text.strip()[:200])


def _json_call(body: Any, shape: str) -> Call:
    """A call from a decoded JSON object with "name" and "arguments" (or "parameters")."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return f"a tool call needs {shape}, got {_short(json.dumps(body))}"
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return f"the arguments of {body['name']!r} must be a JSON object, got {arguments!r}"
    return ToolCall(body["name"], arguments)


def _blocks(
    text: str, open_tag: str, close_tag: str, parse_body: Callable[[str], Call]
) -> tuple[str, list[Call]]:
    """Calls written as open_tag BODY close_tag anywhere in the text, in order; the text
    between them is the answer. An open tag without its close is an error and ends the calls."""
    calls: list[Call] = []
    answer, rest = [], text
    while True:
        start = rest.find(open_tag)
        if start == -1:
            answer.append(rest)
            break
        answer.append(rest[:start])
        end = rest.find(close_tag, start + len(open_tag))
        if end == -1:
            calls.append(f"a {open_tag} without its closing {close_tag}")
            break
        calls.append(parse_body(rest[start + len(open_tag) : end]))
        rest = rest[end + len(close_tag) :]
    return "".join(answer).strip() if calls else text, calls


def parse_hermes(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    def body(inner: str) -> Call:
        try:
            decoded = json.loads(inner.strip())
        except json.JSONDecodeError as e:
            return f"the tool call is not valid JSON ({e.msg}): {_short(inner)}"
        return _json_call(decoded, '{"name": ..., "arguments": {...}}')

    return _blocks(text, "<tool_call>", "</tool_call>", body)


QWEN3_CODER_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
QWEN3_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`;
    the template puts each value between newlines, which are not part of it."""
    types = _declared_types(schemas)

    def body(inner: str) -> Call:
        match = QWEN3_CODER_FUNCTION.fullmatch(inner)
        if not match:
            return f"a tool call needs <function=NAME>...</function>, got {_short(inner)}"
        name = match.group(1).strip()
        declared = types.get(name, {})
        arguments = {}
        for key, value in QWEN3_CODER_PARAMETER.findall(match.group(2)):
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key.strip()] = _typed(value, declared.get(key.strip(), ""))
        return ToolCall(name, arguments)

    return _blocks(text, "<tool_call>", "</tool_call>", body)


GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm45(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`."""
    types = _declared_types(schemas)

    def body(inner: str) -> Call:
        name, _, _ = inner.partition("<arg_key>")
        name = name.strip()
        if not name or not re.fullmatch(r"[^\s<>]+", name):
            return f"a tool call needs NAME<arg_key>...</arg_key>..., got {_short(inner)}"
        declared = types.get(name, {})
        arguments = {
            key.strip(): _typed(value, declared.get(key.strip(), ""))
            for key, value in GLM_ARGUMENT.findall(inner)
        }
        return ToolCall(name, arguments)

    return _blocks(text, "<tool_call>", "</tool_call>", body)


LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """A turn that is one or more JSON calls `{"name": ..., "parameters": {...}}` (separated by
    ";"), possibly after <|python_tag|>, and any text after them. A turn that starts with "{"
    but is not such a call is an answer (a JSON answer is still an answer); after
    <|python_tag|> it is a malformed call."""
    stripped = text.strip()
    tagged = stripped.startswith(LLAMA_PYTHON_TAG)
    if tagged:
        stripped = stripped[len(LLAMA_PYTHON_TAG) :].lstrip()
    elif not stripped.startswith("{"):
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], 0
    shape = '{"name": ..., "parameters": {...}}'
    while position < len(stripped):
        try:
            decoded, position = decoder.raw_decode(stripped, position)
        except json.JSONDecodeError as e:
            if calls:  # text after the calls is the answer's
                return stripped[position:].strip(), calls
            if not tagged:
                return text, []
            return "", [f"the tool call is not valid JSON ({e.msg}): {_short(stripped)}"]
        call = _json_call(decoded, shape)
        if isinstance(call, str) and not calls and not tagged:
            return text, []
        calls.append(call)
        while position < len(stripped) and stripped[position] in " \t\r\n;":
            position += 1
    return "", calls


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def parse_mistral(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """[TOOL_CALLS] then a JSON list of calls, or then NAME[ARGS]{...} (the [ARGS] marker may be
    missing where the text was decoded without special tokens; a [CALL_ID]id before [ARGS] is
    skipped); the text before the first [TOOL_CALLS] is the answer."""
    if MISTRAL_CALLS not in text:
        return text, []
    answer, *parts = text.split(MISTRAL_CALLS)
    decoder, calls = json.JSONDecoder(), []
    shape = '{"name": ..., "arguments": {...}}'
    for part in parts:
        part = part.strip()
        if part.startswith("["):
            try:
                decoded, _ = decoder.raw_decode(part)
            except json.JSONDecodeError as e:
                calls.append(f"the tool calls are not valid JSON ({e.msg}): {_short(part)}")
                continue
            if not isinstance(decoded, list):
                calls.append(f"[TOOL_CALLS] needs a JSON list of calls, got {_short(part)}")
                continue
            calls += [_json_call(item, shape) for item in decoded]
            continue
        name, _, arguments = part.partition("{")
        name = name.replace(MISTRAL_ARGS, "").split(MISTRAL_CALL_ID)[0].strip()
        if not name or not arguments:
            calls.append(f"[TOOL_CALLS] needs NAME[ARGS]{{...}}, got {_short(part)}")
            continue
        try:
            decoded, _ = decoder.raw_decode("{" + arguments)
        except json.JSONDecodeError as e:
            calls.append(f"the arguments of {name!r} are not valid JSON ({e.msg})")
            continue
        calls.append(_json_call({"name": name, "arguments": decoded}, shape))
    return answer.strip(), calls


DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
DEEPSEEK_V3_BODY = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n```\s*", re.DOTALL)


def parse_deepseek_v3(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """<｜tool▁calls▁begin｜> and one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call:
    `function<｜tool▁sep｜>NAME` and a ```json block (V3, R1-0528), or `NAME<｜tool▁sep｜>{...}`
    (V3.1); the text before the calls is the answer."""
    start = text.find(DEEPSEEK_CALLS_BEGIN)
    if start == -1:
        return text, []
    answer, section = text[:start], text[start + len(DEEPSEEK_CALLS_BEGIN) :]
    closed = DEEPSEEK_CALLS_END in section
    section = section.split(DEEPSEEK_CALLS_END)[0]
    shape = '{"name": ..., "arguments": {...}}'

    def body(inner: str) -> Call:
        kind, sep, rest = inner.partition(DEEPSEEK_SEP)
        if not sep:
            return f"a tool call needs NAME{DEEPSEEK_SEP}ARGUMENTS, got {_short(inner)}"
        v3 = DEEPSEEK_V3_BODY.fullmatch(rest) if kind.strip() == "function" else None
        name, arguments = (v3.group(1), v3.group(2)) if v3 else (kind.strip(), rest)
        try:
            decoded = json.loads(arguments.strip())
        except json.JSONDecodeError as e:
            return f"the arguments of {name!r} are not valid JSON ({e.msg})"
        return _json_call({"name": name.strip(), "arguments": decoded}, shape)

    _, calls = _blocks(section, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, body)
    if not closed and not any(isinstance(c, str) for c in calls):
        calls.append(f"a {DEEPSEEK_CALLS_BEGIN} without its closing {DEEPSEEK_CALLS_END}")
    return answer.strip(), calls


def parse_none(text: str, schemas: Schemas = None) -> tuple[str, list[Call]]:
    """No tool calls: the answer is all content."""
    return text, []


TOOL_PARSERS: dict[str, Callable[[str, Schemas], tuple[str, list[Call]]]] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "deepseek_v3": parse_deepseek_v3,
    "glm45": parse_glm45,
    "none": parse_none,
}


# ---------------------------------------------------------------------------------------------
# Choosing the family, and the turn as a message


def detect_tool_parser(template: str) -> str:
    """The tool parser a chat template's text asks for (what it tells the model to write or how
    it renders an assistant's tool_calls); "hermes" when it names no family."""
    if "<arg_key>" in template:
        return "glm45"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if MISTRAL_CALLS in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and (
        LLAMA_PYTHON_TAG in template or '"parameters"' in template
    ):
        return "llama3_json"
    return "hermes"


def detect_reasoning_parser(template: str) -> str:
    """ "think" for a template that writes or strips <think> blocks, else "none"."""
    return "think" if THINK_OPEN in template or THINK_CLOSE in template else "none"


@dataclass(frozen=True)
class TurnParser:
    """How a run reads its model's turns: a reasoning parser and a tool parser, by name."""

    tool: str = "hermes"
    reasoning: str = "none"

    def __post_init__(self) -> None:
        if self.tool not in TOOL_PARSERS:
            raise ValueError(f"no tool parser {self.tool!r}; there are {', '.join(TOOL_PARSERS)}")
        if self.reasoning not in REASONING_PARSERS:
            names = ", ".join(REASONING_PARSERS)
            raise ValueError(f"no reasoning parser {self.reasoning!r}; there are {names}")

    def message(self, text: str, *, tools: Schemas = None, prompt_tail: str = "") -> dict[str, Any]:
        """The assistant message of a model turn `text` (`assistant_message`); tool calls are
        looked for only when the episode offers tools (`tools` is not None), so that an
        environment without tools gets its answer whole. `prompt_tail`: the end of the turn's
        context, which may have opened a reasoning block."""
        opened = opens_reasoning(prompt_tail, self.reasoning)
        reasoning, answer = REASONING_PARSERS[self.reasoning](text, opened)
        content, calls = answer, []
        if tools is not None:
            content, calls = TOOL_PARSERS[self.tool](answer, tools)
        return assistant_message(text, content, reasoning, calls)


def turn_parser(template: Optional[str], tool: str = "auto", reasoning: str = "auto") -> TurnParser:
    """The TurnParser of rollout.tool_parser and rollout.reasoning_parser, "auto" resolved from
    the chat template's text (no template: "hermes" and "none")."""
    text = template or ""
    return TurnParser(
        tool=detect_tool_parser(text) if tool == "auto" else tool,
        reasoning=detect_reasoning_parser(text) if reasoning == "auto" else reasoning,
    )


def read_turn(
    tokenizer,
    parser: TurnParser,
    token_ids: Sequence[int],
    *,
    stopped: bool,
    context_ids: Sequence[int] = (),
    tools: Schemas = None,
    keep_special_tokens: bool = True,
) -> dict[str, Any]:
    """The assistant message of a sampled turn `token_ids` (ended by its stop token when
    `stopped`) after the context `context_ids`: its text decoded with the special tokens but
    the stop token (without any when keep_special_tokens is False, the environment's choice),
    read by `parser`. Every reader of a sampled turn goes through here, so an episode, its
    reward and a held-out score see the same text."""
    if keep_special_tokens:
        ids = token_ids[:-1] if stopped else token_ids
        text = tokenizer.decode(list(ids), skip_special_tokens=False)
    else:
        text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    # The context's end says whether the prompt opened a reasoning block the turn starts in.
    tail = tokenizer.decode(list(context_ids[-8:]), skip_special_tokens=False)
    return parser.message(text, tools=tools, prompt_tail=tail)


def assistant_message(
    text: str, content: str, reasoning: str, calls: Sequence[Call]
) -> dict[str, Any]:
    """A model turn as the environment gets it (fnt.rollout.environments.protocol):
    {"role": "assistant", "content": the answer, "reasoning": the reasoning ("" when none),
    "tool_calls": [{"type": "function", "function": {"name", "arguments"}}, ...], "text": the
    whole turn as sampled}; a malformed call is {"type": "function", "function": {"name": "",
    "arguments": {}}, "error": why}."""
    tool_calls = []
    for call in calls:
        if isinstance(call, ToolCall):
            function = {"name": call.name, "arguments": dict(call.arguments)}
            tool_calls.append({"type": "function", "function": function})
        else:
            empty = {"name": "", "arguments": {}}
            tool_calls.append({"type": "function", "function": empty, "error": call})
    return {
        "role": "assistant",
        "content": content,
        "reasoning": reasoning,
        "tool_calls": tool_calls,
        "text": text,
    }


def message_calls(message: Message, tool_parser: str = "hermes") -> list[Call]:
    """The calls of an assistant message: its "tool_calls" (`assistant_message`), or, for a
    message without them (one an environment made itself), its content parsed by `tool_parser`."""
    if "tool_calls" not in message:
        return TOOL_PARSERS[tool_parser](message["content"], None)[1]
    calls: list[Call] = []
    for entry in message["tool_calls"] or ():
        if "error" in entry:
            calls.append(str(entry["error"]))
            continue
        function = entry.get("function", entry)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"the arguments of {function.get('name')!r} must be a JSON object")
            continue
        calls.append(ToolCall(str(function.get("name", "")), arguments))
    return calls
