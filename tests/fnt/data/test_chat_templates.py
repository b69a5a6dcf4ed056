"""Loss masks under the real chat templates of five model families (tests/fixtures/chat_templates).

Every expectation is the decoded text of each sample's target runs: what the model is trained to
write, which must be the assistant's text and the family's end-of-turn token, and nothing of the
template's scaffolding (headers, Qwen3's empty think block, the newline after a turn).
"""

from __future__ import annotations

import pytest

from fnt.data.chat import ChatMasking, tokenize_conversation
from fnt.model.tokenizer import stop_token_ids
from tests.chat_fixtures import FAMILIES, fixture_tokenizer, load_fixture

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
MULTI = SINGLE + [
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
SYSTEM = [{"role": "system", "content": "Be brief."}] + MULTI
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call00001",  # Mistral wants 9 characters
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ],
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    TOOL_CALL,
    {"role": "tool", "tool_call_id": "call00001", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."},
]
CASES = {"single": (SINGLE, None), "multi": (MULTI, None), "system": (SYSTEM, None)}
CASES["tool"] = (TOOL_CHAT, TOOLS)

# Per family and case: per sample, the decoded target runs. Several samples where the template
# rewrites history (each turn is then trained as the model met it).
QWEN3_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)
EXPECTED = {
    "qwen3": {
        "single": [["4.<|im_end|>"]],
        "multi": [["4.<|im_end|>"], ["6.<|im_end|>"]],
        "system": [["4.<|im_end|>"], ["6.<|im_end|>"]],
        "tool": [[QWEN3_CALL], ["It is 18C.<|im_end|>"]],
    },
    "llama3": {
        "single": [["4.<|eot_id|>"]],
        "multi": [["4.<|eot_id|>", "6.<|eot_id|>"]],
        "system": [["4.<|eot_id|>", "6.<|eot_id|>"]],
        "tool": [
            [
                '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                "It is 18C.<|eot_id|>",
            ]
        ],
    },
    "gemma2": {
        "single": [["4.<end_of_turn>"]],
        "multi": [["4.<end_of_turn>", "6.<end_of_turn>"]],
    },
    "mistral": {
        "single": [["4.</s>"]],
        "multi": [["4.</s>", "6.</s>"]],
        # The template puts the system prompt into the last user turn only.
        "system": [["4.</s>"], ["6.</s>"]],
        "tool": [
            [
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                '"id": "call00001"}]</s>',
                "It is 18C.</s>",
            ]
        ],
    },
    "phi3": {
        "single": [["4.<|end|>"]],
        "multi": [["4.<|end|>", "6.<|end|>"]],
        "system": [["4.<|end|>", "6.<|end|>"]],
    },
}


def target_runs(ids: list[int], targets: list[bool]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, (token, is_target) in enumerate(zip(ids, targets)):
        if is_target:
            if i == 0 or not targets[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    return {family: fixture_tokenizer(tiny_model_dir, family) for family in FAMILIES}


def masking_for(tokenizer, **options) -> ChatMasking:
    return ChatMasking(stop_ids=stop_token_ids(tokenizer, None), **options)


def decoded(tokenizer, samples) -> list[list[str]]:
    return [[tokenizer.decode(run) for run in target_runs(*sample)] for sample in samples]


def test_there_are_five_families_each_naming_its_source():
    assert set(FAMILIES) == set(EXPECTED)
    for family in FAMILIES:
        fixture = load_fixture(family)
        assert fixture["family"] == family and "tokenizer_config.json" in fixture["source"]
        assert "{%" in fixture["chat_template"] and fixture["eos_token"]


def test_each_family_is_tested_with_every_sample_its_template_supports():
    for family in FAMILIES:
        fixture = load_fixture(family)
        supported = {"single", "multi"}
        supported |= {"system"} if fixture["supports_system"] else set()
        supported |= {"tool"} if fixture["supports_tools"] else set()
        assert set(EXPECTED[family]) == supported, family


@pytest.mark.parametrize(
    ("family", "case"), [(family, case) for family in EXPECTED for case in EXPECTED[family]]
)
def test_each_family_masks_each_sample_to_the_assistant_text_and_its_end_of_turn(
    tokenizers, family, case
):
    tokenizer = tokenizers[family]
    messages, tools = CASES[case]
    samples = tokenize_conversation(messages, tokenizer, masking_for(tokenizer), tools=tools)
    assert decoded(tokenizer, samples) == EXPECTED[family][case]
    if len(samples) == 1:  # the whole chat, tokenized as rendered
        whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert tokenizer.decode(samples[0][0]) == whole


def test_a_system_prompt_the_template_refuses_is_an_error_not_a_mask(tokenizers):
    tokenizer = tokenizers["gemma2"]
    with pytest.raises(ValueError, match="System role not supported"):
        tokenize_conversation(SYSTEM, tokenizer, masking_for(tokenizer))


def test_each_turn_of_a_rewritten_history_is_the_prompt_the_model_met_then_its_answer(tokenizers):
    for family in ("qwen3", "mistral"):
        tokenizer = tokenizers[family]
        samples = tokenize_conversation(SYSTEM, tokenizer, masking_for(tokenizer))
        answers = [i for i, m in enumerate(SYSTEM) if m["role"] == "assistant"]
        for (ids, targets), k in zip(samples, answers, strict=True):
            first = targets.index(True)
            prompt = tokenizer.apply_chat_template(
                SYSTEM[:k], tokenize=False, add_generation_prompt=True
            )
            # Qwen3 with thinking off: the empty think block belongs to the prompt.
            assert tokenizer.decode(ids[:first]) in (prompt, prompt + "<think>\n\n</think>\n\n")
            assert "Be brief." in tokenizer.decode(ids[:first])


REASONED = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
]


def test_qwen3_reasoning_is_trained_in_its_own_turn_or_not_at_all(tokenizers):
    tokenizer = tokenizers["qwen3"]
    on = tokenize_conversation(REASONED, tokenizer, masking_for(tokenizer))
    assert decoded(tokenizer, on) == [
        ["<think>\nr1\n</think>\n\na1<|im_end|>"],
        ["<think>\nr2\n</think>\n\na2<|im_end|>"],
    ]
    # The second sample's history shows turn 1 the way Qwen3 renders history: without reasoning.
    assert "<|im_start|>assistant\na1<|im_end|>" in tokenizer.decode(on[1][0])
    off = tokenize_conversation(REASONED, tokenizer, masking_for(tokenizer, reasoning=False))
    assert decoded(tokenizer, off) == [["a1<|im_end|>"], ["a2<|im_end|>"]]
    assert [ids for ids, _ in off] == [ids for ids, _ in on]  # same text, other targets


def test_final_turn_only_is_one_sample_the_whole_chat(tokenizers):
    for family, end in (("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        tokenizer = tokenizers[family]
        samples = tokenize_conversation(MULTI, tokenizer, masking_for(tokenizer, turns="last"))
        assert decoded(tokenizer, samples) == [[f"6.{end}"]]
        assert tokenizer.decode(samples[0][0]) == tokenizer.apply_chat_template(
            MULTI, tokenize=False
        )


def test_other_roles_are_trained_once_each_and_only_their_content(tokenizers):
    qwen3 = tokenizers["qwen3"]
    roles = frozenset({"system", "user", "assistant"})
    samples = tokenize_conversation(SYSTEM, qwen3, masking_for(qwen3, roles=roles))
    assert decoded(qwen3, samples) == [
        ["Be brief.", "What is 2+2?", "4.<|im_end|>"],
        ["And 3+3?", "6.<|im_end|>"],
    ]
    tool_only = tokenize_conversation(
        TOOL_CHAT, qwen3, masking_for(qwen3, roles=frozenset({"tool"})), tools=TOOLS
    )
    assert decoded(qwen3, tool_only) == [["18C"]]
    llama3 = tokenizers["llama3"]
    samples = tokenize_conversation(MULTI, llama3, masking_for(llama3, roles=frozenset({"user"})))
    assert decoded(llama3, samples) == [["What is 2+2?", "And 3+3?"]]
