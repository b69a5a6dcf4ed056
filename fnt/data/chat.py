"""Turn one JSONL record into token ids and a loss mask via the chat template. Pure, except
`chat_masking`, which reads the data.chat_template file (when it names one) and the model
directory's generation_config.json (fnt.model.tokenizer.stop_token_ids).

Record forms (`read_record`; `RECORD_FORMS`):
- `{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`: a chat, rendered with the
  chat template (`tools`, optional, is passed to the template). Extra keys in a message (e.g.
  `name`, `tool_calls`, `reasoning_content`) are passed to the template unchanged.
- `{"conversations": [{"from": ..., "value": ...}, ...]}`: a ShareGPT chat, read as messages with
  `from` mapped to a role (`SHAREGPT_ROLES`: human and user to user; gpt, assistant and model to
  assistant; system to system; tool, function and observation to tool; case ignored) and
  `value` as the content. A chat under `messages` may use these keys too, and `conversations`
  may hold role/content messages.
- `{"prompt": ..., "completion": ...}`: rendered as the chat
  `[user: prompt, assistant: completion]`, so both formats go through the same template and look
  alike to the model.
- `{"text": ...}`, in a record with none of the keys above: plain text, no template, every token
  trained (`tokenize_text`, as TRL's plain-text SFT: the tokenizer's eos appended, its bos
  where it adds one).
A message's content may also be a list of parts, OpenAI's form: its text parts
(`{"type": "text", "text": ...}`) are joined with newlines, as vLLM's chat server joins them; a
part of any other type is an error. Other top-level keys (e.g. `id`) are ignored.

Which tokens are targets (`ChatMasking`): the messages of the trained roles (default: assistant
only). An assistant turn is trained from its content through the first stop token after it
(fnt.model.tokenizer.stop_token_ids: eos, generation_config's eos list, the template's end-of-turn
token), so the model learns to stop; what the template puts after that token (ChatML's newline)
is not, since generation stops there. Its reasoning (`reasoning_content`, or `<think>...</think>`
at the start of the content) and the scaffold around it (`<think>\\n`) are trained too when
`reasoning` is on and the turn has reasoning; otherwise they are context. So Qwen3's empty
`<think>\\n\\n</think>\\n\\n` is never a target: it is what the model is given with thinking off.
A message of another trained role has just its content as target.

How the targets are found, for any template:
- Templates with `{% generation %}` blocks mark the assistant tokens themselves; the tokenizer's
  assistant-token mask is used as is.
- Otherwise each trained assistant turn k is rendered the way the model meets it at inference:
  `messages[:k]` with the generation prompt, then `messages[:k+1]`, which must extend it. Where
  the turn's content lies is found by rendering again with the content replaced by a marker
  character: the text where the two renderings differ is the content as the template rendered
  it (trimmed or not), and it must be the content. The other roles' contents are found the same
  way.
- When every turn's rendering, through its last target, is a prefix of the whole conversation's
  (the template renders history the same whatever follows), the record is one sample: the whole
  conversation.
  Templates that rewrite history (Qwen3 drops the reasoning of earlier turns, Mistral moves the
  system prompt into the last user turn) give one sample per trained turn instead, each the
  conversation up to that turn as the model saw it then; training turn k inside the rewritten
  whole would teach it to answer a history it never sees.
A chat these methods cannot mask exactly raises ValueError with the reason.

Text is tokenized piece by piece at the target boundaries, the way inference sees it: the prompt
is tokenized as its own string and the answer's tokens follow it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

from jinja2 import TemplateError

from fnt.config.schema import CHAT_ROLES
from fnt.model.tokenizer import chat_template_text, stop_token_ids

Message = Mapping[str, Any]
Sample = tuple[list[int], list[bool]]

ROLES = CHAT_ROLES
"""Roles a loss mask can name."""

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Characters that mark a message's content in the second rendering; one that the content does
# not contain is used, so the two renderings differ exactly where the content is.
_MARKERS = "\x01\x02\x03\x04\x05\x06\x07\x0e\x0f"


@dataclass(frozen=True)
class ChatMasking:
    """Which tokens of a rendered chat are training targets, and the template that renders it."""

    roles: frozenset[str] = frozenset({"assistant"})
    """Roles whose messages are targets."""
    turns: Literal["all", "last"] = "all"
    """Train every assistant turn, or only the final one."""
    reasoning: bool = True
    """Train an assistant turn's reasoning where the template renders it."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end an assistant turn's targets (fnt.model.tokenizer.stop_token_ids)."""
    chat_template: str | None = None
    """Template text overriding the tokenizer's own; None uses the tokenizer's."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise ValueError(f"loss mask roles must be among {ROLES}, got {unknown}")
        if self.turns not in ("all", "last"):
            raise ValueError(f"turns must be 'all' or 'last', got {self.turns!r}")


RECORD_FORMS = ("messages", "conversations", "prompt/completion", "text")
"""The forms an SFT record is read as (`read_record`), by its keys."""

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""The role of each ShareGPT speaker (a message's `from`, lower-cased)."""


@dataclass(frozen=True)
class SftRecord:
    """One SFT record as read (`read_record`): its form and what it holds."""

    form: str
    """One of RECORD_FORMS: the key the record was read by."""
    messages: list[Message]
    """The chat; empty for a text record."""
    text: str = ""
    """A text record's text."""
    speakers: tuple[str, ...] = ()
    """Per message, its ShareGPT `from` as written ("" for a message with a role)."""
    joined_parts: bool = False
    """Some message's content was a list of text parts, joined."""


def read_record(record: object) -> SftRecord:
    """One parsed record as an SFT record of one of RECORD_FORMS; ValueError says what is wrong
    with a bad record. A record with two chat forms is an error; `text` is read only from a
    record with no chat form (other keys are ignored, so a chat may carry a text column).
    Pure."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    chats = [key for key in ("messages", "conversations") if key in record]
    has_completion = "prompt" in record or "completion" in record
    if len(chats) > 1:
        raise ValueError("a record has either 'messages' or 'conversations', not both")
    if chats and has_completion:
        raise ValueError(f"a record has either {chats[0]!r} or 'prompt'/'completion', not both")
    if chats:
        key = chats[0]
        messages, speakers, joined = read_messages(record[key], key)
        return SftRecord(key, _checked_messages(messages, key), "", speakers, joined)
    if has_completion:
        for key in ("prompt", "completion"):
            if key not in record:
                raise ValueError(f"a prompt/completion record needs key {key!r}")
            if not isinstance(record[key], str):
                raise ValueError(f"{key!r} must be a string, got {type(record[key]).__name__}")
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
        return SftRecord("prompt/completion", messages)
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError(f"'text' must be a string, got {type(record['text']).__name__}")
        return SftRecord("text", [], record["text"])
    raise ValueError(
        "expected keys 'prompt' and 'completion', or 'messages', or 'conversations', or 'text'; "
        f"got keys {sorted(record)}"
    )


def conversation_from_record(record: object) -> list[Message]:
    """The messages of one parsed JSONL record (`read_record`; none for a text record);
    ValueError says what is wrong with a bad record."""
    return read_record(record).messages


def read_messages(items: object, key: str) -> tuple[object, tuple[str, ...], bool]:
    """A chat's items as role/content messages, the ShareGPT speaker of each ("" for an item
    with a role) and whether a content was a list of text parts (joined); ValueError, naming
    `key[i]`, for a ShareGPT item without a known `from` or a string `value`, and for a content
    part that is not text. What is not a list, or an item that is not an object, is returned as
    it is, for `check_message_list` to name. Pure."""
    if not isinstance(items, list):
        return items, (), False
    messages, speakers, joined = [], [], False
    for i, item in enumerate(items):
        speaker = ""
        if (
            isinstance(item, Mapping)
            and "role" not in item
            and (key == "conversations" or "from" in item or "value" in item)
        ):
            speaker, item = _sharegpt_message(item, f"{key}[{i}]")
        if isinstance(item, Mapping) and isinstance(item.get("content"), list):
            where = f"{key}[{i}].{'value' if speaker else 'content'}"
            item = {**item, "content": joined_text_parts(item["content"], where)}
            joined = True
        messages.append(item)
        speakers.append(speaker)
    return messages, tuple(speakers) if any(speakers) else (), joined


def _sharegpt_message(item: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """(speaker, message) of a ShareGPT item: `from` as the role, `value` as the content."""
    speaker = item.get("from")
    if not isinstance(speaker, str):
        raise ValueError(
            f"{where} needs a string 'from' (ShareGPT's speaker: human, gpt, system...) or a 'role'"
        )
    role = SHAREGPT_ROLES.get(speaker.lower())
    if role is None:
        mapping = ", ".join(
            f"{'/'.join(s for s, r in SHAREGPT_ROLES.items() if r == role)} -> {role}"
            for role in dict.fromkeys(SHAREGPT_ROLES.values())
        )
        raise ValueError(
            f"{where} has 'from' {speaker!r}, which is no role fnt reads ({mapping}); write "
            "the message with a 'role' the chat template renders instead"
        )
    value = item.get("value")
    if not isinstance(value, (str, list)):
        raise ValueError(f"{where} needs a string 'value'")
    rest = {k: v for k, v in item.items() if k not in ("from", "value")}
    return speaker, {"role": role, "content": value, **rest}


def joined_text_parts(parts: list, where: str) -> str:
    """A content given as a list of parts (`[{"type": "text", "text": ...}, ...]`), its texts
    joined with newlines as vLLM's chat server joins them; ValueError naming `where[j]` for a
    part that is not text (an image, say: fnt trains text only). Pure."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{j}] must be an object, got {type(part).__name__}")
        if not isinstance(part.get("type"), str):
            raise ValueError(f"{where}[{j}] needs a string 'type' (\"text\" and a 'text')")
        if part["type"] != "text":
            raise ValueError(
                f"{where}[{j}] is a part of type {part['type']!r}: fnt trains on text only "
                '(parts {"type": "text", "text": ...})'
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}] needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def tokenize_text(text: str, tokenizer) -> Sample:
    """A text record's tokens as TRL's plain-text SFT makes them: the tokenizer's eos appended
    (unless the text ends with it), tokenized with the tokenizer's special tokens (a bos for a
    tokenizer that adds one); every token a target (fit_to_length clears the first, which has
    nothing to be predicted from)."""
    eos = tokenizer.eos_token
    if eos and not text.endswith(eos):
        text += eos
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return ids, [True] * len(ids)


def empty_turns(messages: Sequence[Message], masking: ChatMasking) -> list[int]:
    """The trained assistant turns with nothing to train but their end token (and white
    space): no answer, no tool call and no trained reasoning. Pure."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if "assistant" not in masking.roles:
        return []
    if masking.turns == "last":
        turns = turns[-1:]
    return [
        i
        for i in turns
        if not _split_reasoning(messages[i])[1].strip()
        and not _calls_tools(messages[i])
        and not (masking.reasoning and _reasoning_of(messages[i]).strip())
    ]


BAD_SAMPLE_POLICIES = ("auto", "error", "skip")

# A role a template tests for by name: `message.role == "ipython"`, `message['role'] in ['a', 'b']`.
_ROLE_TEST = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"]([\w-]+)['"]""")
_ROLE_IN = re.compile(r"""role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")


def template_roles(template: str) -> frozenset[str]:
    """The roles a chat template renders: fnt's four (system, user, assistant, tool) and every
    role the template compares a message's role with by name. Pure."""
    named = set(_ROLE_TEST.findall(template))
    for listed in _ROLE_IN.findall(template):
        named.update(re.findall(r"""['"]([\w-]+)['"]""", listed))
    return frozenset(ROLES) | named


def chat_problem(
    messages: Sequence[Message], *, known_roles: frozenset[str], trained_roles: frozenset[str]
) -> tuple[str, str] | None:
    """What is wrong with a well-formed chat, as (kind, reason): kind "bad" for a message whose
    role the template does not render, "no_trained_turn" for a chat without a message of a
    trained role (nothing in it would be learned); None for a good chat. Pure."""
    for i, message in enumerate(messages):
        if message["role"] not in known_roles:
            return "bad", (
                f"messages[{i}] has role {message['role']!r}, which the chat template does not "
                f"render (known roles: {', '.join(sorted(known_roles))})"
            )
    if not any(message["role"] in trained_roles for message in messages):
        return "no_trained_turn", (
            f"no message of a trained role ({', '.join(sorted(trained_roles))}; data.loss_mask)"
        )
    return None


def bad_sample_action(kind: str, policy: str) -> str:
    """ "error" or "skip" for a problem of `kind` ("bad" or "no_trained_turn") under
    data.on_bad_sample: "auto" errors on bad chats and skips chats without a trained turn. Pure."""
    if policy not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"data.on_bad_sample must be one of {BAD_SAMPLE_POLICIES}, got {policy!r}")
    if policy == "auto":
        return "skip" if kind == "no_trained_turn" else "error"
    return policy


def tools_from_record(record: Mapping[str, Any]) -> list | None:
    """The record's `tools` (function specs passed to the template), or None."""
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list, got {type(tools).__name__}")
    return tools or None


def check_message_list(messages: object, key: str = "messages") -> None:
    """ValueError unless `messages` (the record's `key`) is a non-empty list of {"role": str,
    "content": str}; as in OpenAI's format, a message with `tool_calls` may have a null (or no)
    content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{key!r} must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{key}[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"{key}[{i}] needs a string 'role'")
        content = message.get("content")
        if not (isinstance(content, str) or (content is None and _calls_tools(message))):
            raise ValueError(f"{key}[{i}] needs a string 'content'")


def _calls_tools(message: Message) -> bool:
    calls = message.get("tool_calls")
    return isinstance(calls, list) and bool(calls)


def _checked_messages(messages: object, key: str = "messages") -> list[Message]:
    check_message_list(messages, key)
    if messages[0]["role"] == "assistant":
        # The template cannot render an empty prompt, so the assistant header could not be told
        # apart from the answer and would be trained on.
        raise ValueError(f"{key}[0] must not be an assistant message")
    # A tool call's null content is rendered as no text (templates and the masking want text).
    return [
        {**message, "content": ""} if message.get("content") is None else message
        for message in messages
    ]


def without_untrained_tail(
    messages: Sequence[Message], roles: frozenset[str]
) -> tuple[list[Message], int]:
    """The messages up to the last one of a trained role, and how many were cut after it (a
    trailing user turn, say: nothing trains on it, and it would sit after the answer). Pure."""
    last = max((i for i, m in enumerate(messages) if m["role"] in roles), default=len(messages) - 1)
    return list(messages[: last + 1]), len(messages) - last - 1


def unrendered_tool_parts(
    messages: Sequence[Message], tools: list | None, rendered: str
) -> list[str]:
    """The tools and tool calls of a chat whose function name the rendered chat does not show:
    a template that ignores `tools` or `tool_calls` would train the turn without them. Pure."""
    missing = []
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            name = _function_name(call)
            if name and name not in rendered:
                missing.append(f"messages[{i}].tool_calls ({name!r})")
    for tool in tools or []:
        name = _function_name(tool)
        if name and name not in rendered:
            missing.append(f"tools ({name!r})")
    return missing


def _function_name(entry: object) -> str | None:
    """The function name of an OpenAI-style tool or tool call ({"function": {"name": ...}})."""
    if not isinstance(entry, dict):
        return None
    function = entry.get("function")
    name = function.get("name") if isinstance(function, dict) else entry.get("name")
    return name if isinstance(name, str) else None


def check_tools_rendered(
    messages: Sequence[Message], tokenizer, masking: ChatMasking, tools: list | None
) -> None:
    """ValueError naming the tools and tool calls the chat template drops from this chat."""
    if not tools and not any(_calls_tools(m) for m in messages):
        return
    template = masking.chat_template or tokenizer.chat_template
    rendered = apply_template(tokenizer, messages, tools, template, tokenize=False)
    missing = unrendered_tool_parts(messages, tools, rendered)
    if missing:
        raise ValueError(
            f"the chat template does not render {', '.join(missing)}: the sample would train "
            "without them. Use a template that renders tools (data.chat_template), or leave "
            "them out of the data"
        )


def apply_template(tokenizer, messages: Sequence[Message], tools, template: str, **options):
    """`tokenizer.apply_chat_template` of the messages with `template`; a template's own error
    becomes a ValueError, which the loader reports with the record's file and line."""
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, chat_template=template, **options
        )
    except TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e


def has_generation_blocks(template: str) -> bool:
    """Whether the template marks assistant text with `{% generation %}` blocks."""
    return bool(GENERATION_BLOCK.search(template))


def tokenize_conversation(
    messages: Sequence[Message], tokenizer, masking: ChatMasking, *, tools: list | None = None
) -> list[Sample]:
    """The samples of one chat: token ids and, per token, whether it is a training target.

    One sample, unless the template rewrites history and several turns are trained (see the
    module docstring)."""
    template = masking.chat_template or tokenizer.chat_template
    if not template:
        raise ValueError("the tokenizer has no chat template, and data.chat_template is empty")

    def render(msgs: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        return apply_template(
            tokenizer,
            msgs,
            tools,
            template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    if has_generation_blocks(template):
        return [_generation_sample(messages, tokenizer, masking, template, tools)]

    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained_turns = assistant_turns if "assistant" in masking.roles else []
    if masking.turns == "last":
        trained_turns = trained_turns[-1:]
    other_trained = [
        i for i, m in enumerate(messages) if m["role"] != "assistant" and m["role"] in masking.roles
    ]
    stop_texts = [tokenizer.convert_ids_to_tokens(i) for i in sorted(masking.stop_ids)]
    whole = render(messages)
    turns = [_assistant_turn(messages, k, render, masking, stop_texts) for k in trained_turns]
    # One sample when the whole conversation shows the model, up to each turn's last target,
    # exactly what it saw at that turn (what a template adds after a turn's stop token, such as
    # Phi-3's trailing eos, does not count).
    if all(whole.startswith(text[:end]) for text, (_, end) in turns):
        spans = [span for _, span in turns]
        spans += [_content_span(messages, j, render) for j in other_trained]
        return [_encode(whole, spans, tokenizer)]

    samples = []
    done = -1  # messages up to here have been placed in a sample
    for k, (text, span) in zip(trained_turns, turns):
        # The sample starts with turn k's generation prompt, the rendering of messages[:k].
        spans = [span] + [
            _content_span(messages[:k], j, render, add_generation_prompt=True)
            for j in other_trained
            if done < j < k
        ]
        samples.append(_encode(text, spans, tokenizer))
        done = k
    rest = [j for j in other_trained if j > done]
    if rest:
        spans = [_content_span(messages, j, render) for j in rest]
        samples.append(_encode(whole, spans, tokenizer))
    return samples


def _assistant_turn(
    messages: Sequence[Message],
    k: int,
    render: Callable[..., str],
    masking: ChatMasking,
    stop_texts: Sequence[str],
) -> tuple[str, tuple[int, int]]:
    """Assistant turn k as the model meets it, its generation prompt and then the turn, and the
    character span of its targets in that text."""
    prompt = render(messages[:k], add_generation_prompt=True)
    text = render(messages[: k + 1])
    located = _locate_content(messages[: k + 1], k, render)
    if not text.startswith(prompt):
        # The template renders the history differently once the turn is there (Mistral drops
        # the system prompt from an answered user turn): splice the turn onto the prompt.
        cut = _turn_start(text, prompt, messages, k, render)
        if located is not None and located[0] < cut:
            raise ValueError(f"messages[{k}]: its content was found before the turn starts")
        shift = len(prompt) - cut
        text = prompt + text[cut:]
        located = located and (located[0] + shift, located[1] + shift)
    answer = _split_reasoning(messages[k])[1]
    if located is None:
        if answer.strip():
            raise ValueError(f"messages[{k}]: the chat template does not render its content")
        located = (len(prompt), len(prompt))  # e.g. a tool-call turn whose content is empty
    answer_start, answer_end = located
    if answer_start < len(prompt):
        raise ValueError(f"messages[{k}]: its content was found inside the generation prompt")
    reasoning = _reasoning_of(messages[k]).strip()
    start = answer_start
    if masking.reasoning and reasoning:
        if reasoning not in text[len(prompt) : answer_start]:
            raise ValueError(
                f"messages[{k}]: the chat template does not render this turn's reasoning, so it "
                "cannot be trained; set data.train_reasoning = false or use a template that "
                "renders it"
            )
        start = len(prompt)
    stops = [at + len(s) for s in stop_texts if (at := text.find(s, answer_end)) >= 0]
    return text, (start, min(stops, default=len(text)))


def _turn_start(
    text: str, prompt: str, messages: Sequence[Message], k: int, render: Callable[..., str]
) -> int:
    """Where assistant turn k's own text starts in `text` (the rendering of messages[:k+1])
    when `text` does not start with `prompt`: after the previous message's content and the
    text that follows that content in the prompt (its closing and the generation prompt)."""
    failure = ValueError(
        f"messages[{k}]: the rendered conversation does not continue its generation prompt "
        f"(the prompt ends {prompt[-40:]!r}), and the turn cannot be placed after it, so the "
        "turn the model would be trained on is not the one it meets at inference; set "
        "data.chat_template to a template that renders the history as the prompt does"
    )
    in_text = _locate_content(messages[: k + 1], k - 1, render)
    in_prompt = _locate_content(messages[:k], k - 1, render, add_generation_prompt=True)
    if in_text is None or in_prompt is None or not messages[k - 1]["content"].strip():
        raise failure
    tail = prompt[in_prompt[1] :]
    if not text[in_text[1] :].startswith(tail):
        raise failure
    return in_text[1] + len(tail)


def _content_span(
    messages: Sequence[Message],
    j: int,
    render: Callable[..., str],
    *,
    add_generation_prompt: bool = False,
) -> tuple[int, int]:
    located = _locate_content(messages, j, render, add_generation_prompt=add_generation_prompt)
    if located is None:
        if messages[j]["content"].strip():
            raise ValueError(f"messages[{j}]: the chat template does not render its content")
        return (0, 0)
    return located


def _locate_content(
    messages: Sequence[Message],
    j: int,
    render: Callable[..., str],
    *,
    add_generation_prompt: bool = False,
) -> tuple[int, int] | None:
    """Character span of messages[j]'s content (its answer, for an assistant) in the rendering
    of `messages`; None when the template does not render it."""
    head, answer = _split_reasoning(messages[j])
    # A content that holds every marker character still gets one that differs from its answer's
    # first and last characters (trimmed or not), which is all the two renderings' difference
    # needs to start and end exactly at the answer.
    ends = {answer[:1], answer[-1:], answer.strip()[:1], answer.strip()[-1:]}
    marker = next((c for c in _MARKERS if c not in messages[j]["content"]), None) or next(
        c for c in _MARKERS if c not in ends
    )
    marked = list(messages)
    marked[j] = {**messages[j], "content": head + marker}
    text = render(messages, add_generation_prompt=add_generation_prompt)
    other = render(marked, add_generation_prompt=add_generation_prompt)
    if other == text:
        return None
    start = _common_prefix(text, other)
    end = len(text) - _common_prefix(text[start:][::-1], other[start:][::-1])
    rendered = text[start:end]
    if rendered.strip() != answer.strip() or rendered not in answer:
        raise ValueError(
            f"messages[{j}]: the chat template renders its content as {rendered[:60]!r}, not as "
            "the content itself (trimmed at most), so its tokens cannot be located"
        )
    return start, end


def _split_reasoning(message: Message) -> tuple[str, str]:
    """(inline reasoning block, answer) of an assistant message's content."""
    content = message["content"]
    if message["role"] == "assistant" and "</think>" in content:
        answer = content.split("</think>")[-1]
        return content[: len(content) - len(answer)], answer
    return "", content


def _reasoning_of(message: Message) -> str:
    if message["role"] != "assistant":
        return ""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"]
    head = _split_reasoning(message)[0]
    return head.removesuffix("</think>").split("<think>")[-1]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _encode(text: str, spans: Sequence[tuple[int, int]], tokenizer) -> Sample:
    """Token ids of `text`, tokenized piece by piece at the span edges, and the targets."""
    spans = sorted(span for span in spans if span[1] > span[0])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError("two messages' target spans overlap in the rendering")
    pieces: list[tuple[str, bool]] = []
    at = 0
    for start, end in spans:
        pieces += [(text[at:start], False), (text[start:end], True)]
        at = end
    pieces.append((text[at:], False))
    pieces = [(piece, is_target) for piece, is_target in pieces if piece]
    encoded = tokenizer([piece for piece, _ in pieces], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    targets: list[bool] = []
    for ids, (_, is_target) in zip(encoded, pieces):
        input_ids += ids
        targets += [is_target] * len(ids)
    return input_ids, targets


def _generation_sample(
    messages: Sequence[Message], tokenizer, masking: ChatMasking, template: str, tools
) -> Sample:
    """The whole chat with the template's `{% generation %}` blocks as the targets."""
    if masking.roles != {"assistant"}:
        raise ValueError(
            "a template with {% generation %} blocks marks only assistant text; data.loss_mask "
            f"= {sorted(masking.roles)} cannot be honoured with it"
        )
    if not masking.reasoning and any(_reasoning_of(m).strip() for m in messages):
        raise ValueError(
            "data.train_reasoning = false cannot be honoured with a {% generation %} template: "
            "the template decides what of a turn is marked"
        )
    out = apply_template(
        tokenizer,
        messages,
        tools,
        template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    input_ids = list(out["input_ids"])
    targets = [bool(t) for t in out["assistant_masks"]]
    if any(m["role"] == "assistant" for m in messages) and not any(targets):
        raise ValueError("the template's {% generation %} blocks mark no token of this chat")
    if masking.turns == "last" and any(targets):
        last_start = max(i for i, t in enumerate(targets) if t and (i == 0 or not targets[i - 1]))
        targets = [t and i >= last_start for i, t in enumerate(targets)]
    return input_ids, targets


class MaskingConfig(Protocol):
    loss_mask: Sequence[str]
    train_turns: str
    train_reasoning: bool
    chat_template: str


def chat_masking(data_cfg: MaskingConfig, tokenizer: Any) -> ChatMasking:
    """The masking settings of `data_cfg` for `tokenizer`, whose directory (its name_or_path)
    holds the model's generation_config.json."""
    template = chat_template_text(data_cfg.chat_template)
    return ChatMasking(
        roles=frozenset(data_cfg.loss_mask),
        turns=data_cfg.train_turns,
        reasoning=data_cfg.train_reasoning,
        stop_ids=stop_token_ids(tokenizer, tokenizer.name_or_path or None, template),
        chat_template=template,
    )
