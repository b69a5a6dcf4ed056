"""Model turns read per model family (fnt.rollout.environments.parsers): each family's parser
found from its real chat template and reading the tool calls that template itself writes; the
reasoning split off before tool calls are looked for, so a call inside the thinking is never run
(the reward-hacking turn of issue 46); the reward text keeping special tokens by default.

Templates: tests/fixtures/chat_templates/*.json (Qwen3, Llama 3.2, Mistral Nemo, Gemma 2,
Phi-3.5) and tests/fixtures/tool_templates/*.jinja (Qwen3-Coder, GLM-4.5, DeepSeek-R1,
Ministral 3), each with its source noted in it."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from fnt.config import RolloutConfig
from fnt.config.schema import ToolParserName
from fnt.rollout.environments import SingleTurnEnvironment, ToolEnvironment
from fnt.rollout.environments.episodes import run_episodes
from fnt.rollout.environments.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ToolCall,
    TurnParser,
    message_calls,
    opens_reasoning,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    split_think,
    turn_parser,
)
from fnt.rollout.rewards import exact_match
from tests.chat_fixtures import load_fixture

from .conftest import rl_config, rl_state
from .test_environments import Scripted, episodes_of, prompt_of, rules

TOOL_TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "tool_templates"


def template_of(name: str) -> str:
    """A real chat template: a tool_templates/*.jinja file, else a chat_templates fixture."""
    path = TOOL_TEMPLATES / f"{name}.jinja"
    return path.read_text() if path.exists() else load_fixture(name)["chat_template"]


# (template, the tool parser and reasoning parser "auto" finds in it, the text that ends the
# assistant's turn in it: the stop token the sampled text would not show)
FAMILIES = [
    ("qwen3", "hermes", "think", "<|im_end|>"),
    ("qwen3_coder", "qwen3_coder", "none", "<|im_end|>"),
    ("llama3", "llama3_json", "none", "<|eot_id|>"),
    ("mistral", "mistral", "none", "</s>"),
    ("ministral3", "mistral", "none", "</s>"),
    ("deepseek_r1", "deepseek_v3", "think", "<｜end▁of▁sentence｜>"),
    ("glm45", "glm45", "think", None),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "fields": {"type": "array"},
            },
            "required": ["city"],
        },
    },
}
CALLS = [
    ToolCall("get_weather", {"city": "Paris", "days": 3, "fields": ["rain", "wind"]}),
    ToolCall("get_weather", {"city": "10", "days": 1, "fields": []}),  # a number-like string
]


def rendered_turn(template: str, message: dict, end: typing.Optional[str]) -> tuple[str, str]:
    """What a model following `template` samples for the assistant `message` (the template's
    rendering of it after the generation prompt, up to the end of its turn), and the generation
    prompt it samples after."""
    user = {"role": "user", "content": "Weather in Paris?"}
    kwargs = dict(chat_template=template, tools=[WEATHER], bos_token="<s>", eos_token="</s>")
    before = render_jinja_template([[user]], **kwargs)[0][0]
    prompt = render_jinja_template([[user]], add_generation_prompt=True, **kwargs)[0][0]
    full = render_jinja_template([[user, message]], **kwargs)[0][0]
    assert prompt.startswith(before) and full.startswith(before)
    generation_prompt, turn = prompt[len(before) :], full[len(before) :]
    # The turn as rendered begins with the generation prompt, as far as the two agree, in whole
    # markers (R1's generation prompt opens <think>; its rendered history has no thinking).
    shared = max(
        i
        for i in range(len(generation_prompt) + 1)
        if turn.startswith(generation_prompt[:i])
        and (i in (0, len(generation_prompt)) or generation_prompt[i - 1] in ">\n")
    )
    turn = turn[shared:]
    return (turn.split(end)[0] if end else turn), generation_prompt


@pytest.mark.parametrize(("name", "tool", "reasoning", "end"), FAMILIES)
def test_auto_finds_the_family_in_its_real_template(name, tool, reasoning, end):
    assert turn_parser(template_of(name)) == TurnParser(tool, reasoning)


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_a_template_without_tools_or_thinking_keeps_the_old_reading(name):
    assert turn_parser(template_of(name)) == TurnParser("hermes", "none")
    assert turn_parser(None) == TurnParser("hermes", "none")


def test_named_parsers_win_over_auto_and_the_config_names_them_all():
    assert turn_parser(template_of("qwen3"), "glm45", "none") == TurnParser("glm45", "none")
    assert set(typing.get_args(ToolParserName)) == {"auto", *TOOL_PARSERS}
    reasoning = typing.get_args(typing.get_type_hints(RolloutConfig)["reasoning_parser"])
    assert set(reasoning) == {"auto", *REASONING_PARSERS}
    with pytest.raises(ValueError, match="no tool parser 'hermez'"):
        TurnParser("hermez")


@pytest.mark.parametrize(("name", "tool", "reasoning", "end"), FAMILIES)
def test_each_parser_reads_the_calls_its_template_writes(name, tool, reasoning, end):
    """The template renders an assistant message with tool calls (one: Llama 3's template
    allows no more); parsed back, it is the same calls, with the same argument types."""
    calls = CALLS[:1] if name == "llama3" else CALLS
    message = {
        "role": "assistant",
        "content": None if name == "deepseek_r1" else "",
        "tool_calls": [
            {
                "id": f"call{k}abcd",  # Mistral's templates want ids of 9 characters
                "type": "function",
                "function": {
                    "name": c.name,
                    # R1's template writes the arguments as given: a JSON string
                    "arguments": json.dumps(c.arguments) if name == "deepseek_r1" else c.arguments,
                },
            }
            for k, c in enumerate(calls)
        ],
    }
    text, generation_prompt = rendered_turn(template_of(name), message, end)
    parser = turn_parser(template_of(name))
    thinking = ""
    if opens_reasoning(generation_prompt, parser.reasoning):  # R1 thinks before it calls
        thinking = "The user wants the weather."
        text = f"{thinking}\n</think>\n\n{text}"
    parsed = parser.message(text, tools=[WEATHER], prompt_tail=generation_prompt)
    assert message_calls(parsed) == calls, text
    assert (parsed["content"], parsed["reasoning"], parsed["text"]) == ("", thinking, text)


@pytest.mark.parametrize("name", ["qwen3", "glm45"])
def test_thinking_templates_reasoning_is_split_from_the_answer(name):
    message = {
        "role": "assistant",
        "content": "It is sunny.",
        "reasoning_content": "The user wants the weather.",
    }
    text, _ = rendered_turn(template_of(name), message, "<|im_end|>")
    assert "<think>" in text
    parsed = turn_parser(template_of(name)).message(text)
    assert (parsed["reasoning"], parsed["content"]) == (
        "The user wants the weather.",
        "It is sunny.",
    )


# The same call, written in each family's format, inside the model's thinking.
CALL_IN_EACH_FORMAT = {
    "hermes": '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=lookup>\n</function>\n</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "lookup", "parameters": {}}',
    "mistral": "[TOOL_CALLS]lookup[ARGS]{}",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n"
    "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "glm45": "<tool_call>lookup\n</tool_call>",
}


@pytest.mark.parametrize("tool", sorted(CALL_IN_EACH_FORMAT))
def test_a_call_inside_the_thinking_is_not_a_call(tool):
    call = CALL_IN_EACH_FORMAT[tool]
    parser = TurnParser(tool, "think")
    assert message_calls(parser.message(call, tools=[])) == [ToolCall("lookup", {})]
    turn = f"<think>I could call {call} but I will not.</think>The answer is cba."
    parsed = parser.message(turn, tools=[])
    assert parsed["tool_calls"] == [] and parsed["content"] == "The answer is cba."
    assert call in parsed["reasoning"]
    # The prompt opened the block (DeepSeek-R1's and Qwen3-Thinking's generation prompts).
    opened = parser.message(f"I could call {call}.</think>cba", tools=[], prompt_tail="<think>\n")
    assert opened["tool_calls"] == [] and opened["content"] == "cba"
    unfinished = parser.message(f"I could call {call}", tools=[], prompt_tail="<think>\n")
    assert unfinished["tool_calls"] == [] and unfinished["content"] == ""


def test_think_blocks_split_where_they_stand():
    assert split_think("no thinking here") == ("", "no thinking here")
    assert split_think("<think>\na\n</think>\n\nb") == ("a", "b")
    assert split_think("a</think>b") == ("a", "b")  # opened by the prompt
    assert split_think("a", opened=True) == ("a", "")  # cut while thinking
    assert split_think("x<think>a</think>y<think>b") == ("a\n\nb", "xy")


def test_the_formats_edge_cases():
    content, calls = parse_hermes('ok <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert content == "ok"  # the malformed call is answered as an error, not left as the answer
    assert calls == ["a <tool_call> without its closing </tool_call>"]
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == (
        "",
        [ToolCall("f", {"a": 1})],
    )
    # Llama: a JSON answer is an answer; several calls separated by ";".
    assert parse_llama3_json('{"answer": 3}') == ('{"answer": 3}', [])
    assert parse_llama3_json('{"name": "f", "parameters": {}}; {"name": "g", "arguments": {}}') == (
        "",
        [ToolCall("f", {}), ToolCall("g", {})],
    )
    assert parse_llama3_json("<|python_tag|>{oops")[1][0].startswith("the tool call is not valid")
    called = parse_llama3_json('{"name": "f", "parameters": {}} done')
    assert called == ("done", [ToolCall("f", {})])
    # Mistral: the JSON list (Nemo), and the v11+ form decoded without its [ARGS] marker.
    assert parse_mistral('Hi[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]') == (
        "Hi",
        [ToolCall("f", {"a": 1})],
    )
    assert parse_mistral('[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g[ARGS]{}') == (
        "",
        [ToolCall("f", {"a": 1}), ToolCall("g", {})],
    )
    assert TOOL_PARSERS["deepseek_v3"](
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    ) == ("", [ToolCall("f", {"a": 1})])  # DeepSeek-V3.1's form


def test_an_environment_without_tools_gets_its_answer_whole():
    parser = TurnParser("hermes", "think")
    call = CALL_IN_EACH_FORMAT["hermes"]
    assert parser.message(f"<think>x</think>{call}")["content"] == call  # tools=None
    assert parser.message(f"<think>x</think>{call}", tools=[])["content"] == ""


def lookup() -> str:
    """The hidden word."""
    return "abc"


def test_the_reward_hacking_turn_runs_no_tool_through_a_real_episode(qwen3_dir):
    """Issue 46: with Qwen3's template and tokens, a turn that writes a call in its thinking and
    then answers ends the episode; the tool never runs and the reward reads the answer."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    ran = []

    def lookup() -> str:
        """The hidden word."""
        ran.append(1)
        return "abc"

    environment = ToolEnvironment([lookup], exact_match)
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    turn = f"<think>I could call {call} but I will not.</think>The answer is cba."
    record = {"prompt": "reverse the hidden word", "answer": "The answer is cba."}
    long = dict(max_new_tokens=512, max_episode_tokens=4096)
    [(episode, _)], samples, _, _ = episodes_of(environment, tokenizer, [turn], [record], **long)
    assert ran == [] and episode.turns == 1 and samples[0].tool_calls == 0
    assert samples[0].reward == 1.0  # the answer, without the thinking
    # The same call outside the thinking runs.
    [(episode, _)], samples, _, _ = episodes_of(
        environment, tokenizer, [call, "cba"], [record], **long
    )
    assert ran == [1, 1] and samples[0].tool_calls == 1 and episode.turns == 2


def test_a_turn_that_starts_inside_the_prompts_think_block(qwen3_dir):
    """A template whose generation prompt opens <think> (Qwen3-Thinking-2507, DeepSeek-R1):
    the turn's text up to </think> is reasoning, found from the end of the context."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    environment = ToolEnvironment([lookup], exact_match)
    record = {"prompt": "reverse the hidden word", "answer": "cba"}
    prompt = prompt_of(record, environment, tokenizer)
    opened = tokenizer("<think>\n", add_special_tokens=False)["input_ids"]
    prompt = dataclasses.replace(prompt, token_ids=prompt.token_ids + tuple(opened))
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = Scripted(tokenizer, [f"maybe {call}?\n</think>\n\ncba"], stop)
    [[episode, _]] = run_episodes([prompt], sampler, environment, tokenizer, rules())
    last = episode.messages[-1]
    assert episode.turns == 1 and episode.tool_calls == 0
    assert (last["content"], last["tool_calls"]) == ("cba", [])
    assert last["reasoning"] == f"maybe {call}?"


def test_the_reward_text_keeps_special_tokens_unless_the_environment_asks(qwen3_dir):
    """`cb<|im_start|>a` is not the answer "cba": the reward reads the turn with its special
    tokens (all but the stop token that ends it); an environment with keep_special_tokens =
    False reads it without them, as fnt's rewards did before."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    record = {"prompt": "reverse abc", "answer": "cba"}
    environment = SingleTurnEnvironment(exact_match)
    [(episode, _)], samples, _, _ = episodes_of(
        environment, tokenizer, ["cb<|im_start|>a"], [record]
    )
    assert episode.messages[-1]["content"] == "cb<|im_start|>a" and samples[0].reward == 0.0
    environment.keep_special_tokens = False
    [(episode, _)], samples, _, _ = episodes_of(
        environment, tokenizer, ["cb<|im_start|>a"], [record]
    )
    assert episode.messages[-1]["content"] == "cba" and samples[0].reward == 1.0


def test_a_message_an_environment_made_itself_is_parsed_from_its_content():
    message = {"role": "assistant", "content": CALL_IN_EACH_FORMAT["hermes"]}
    assert message_calls(message) == [ToolCall("lookup", {})]
    error = {"type": "function", "function": {"name": "", "arguments": {}}, "error": "bad"}
    assert message_calls({"role": "assistant", "content": "", "tool_calls": [error]}) == ["bad"]
    assert json.dumps(TurnParser().message("x", tools=[]))  # messages are plain JSON


def test_the_run_reads_turns_with_the_parsers_its_config_names(policy_dir, prompts_file):
    """rollout.tool_parser and rollout.reasoning_parser reach the episodes; "auto" is the
    tokenizer's template's family."""
    named = rl_state(
        rl_config(policy_dir, prompts_file, tool_parser="glm45", reasoning_parser="none")
    )
    assert named.handles.rollouts.rules.turn_parser == TurnParser("glm45", "none")
    auto = rl_state(rl_config(policy_dir, prompts_file)).handles.rollouts
    assert auto.rules.turn_parser == turn_parser(auto.tokenizer.chat_template)
