"""verifiers tasksets as fnt environments (rollout.environment = "verifiers:TASKSET"): the
taskset's tasks are the prompts, its tools answer the model's calls (their output masked), its
rubric's rewards are the reward, and fnt's in-process engine trains on them.

Tests marked `verifiers` need the extra (`pip install 'fnt[verifiers]'`, `make test-verifiers`);
the others check the config and the missing-extra error without it. This module imports
verifiers only inside the marked tests, so collecting it never needs the package."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest

from fnt.config import ConfigError, RolloutConfig, validate_rollout
from fnt.rollout.environments import environment_of
from fnt.rollout.environments.render import reply_ids

from .conftest import rl_config, rl_state
from .test_engine import check_logprobs_match
from .test_environments import episodes_of

SINGLE = "verifiers:tests.fnt.rollout.vf_single"
TOOLS = "verifiers:tests.fnt.rollout.vf_tools"
TOOL_CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 17, "b": 25}}</tool_call>'


def verifiers_env(name: str, args: str = ""):
    environment, _ = environment_of(RolloutConfig(environment=name, environment_args=args))
    return environment


def test_a_verifiers_environment_without_the_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers raises ImportError
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"needs the verifiers package.*fnt\[verifiers\]"):
        verifiers_env(SINGLE)


def test_a_verifiers_environment_gives_the_prompts_and_environment_args_need_one():
    with pytest.raises(ConfigError, match=r"'rollout.prompts' = 'p.jsonl': the verifiers taskset"):
        validate_rollout(RolloutConfig(prompts="p.jsonl", environment=SINGLE), dp_size=1)
    validate_rollout(RolloutConfig(environment=SINGLE, environment_args='{"n": 1}'), dp_size=1)
    with pytest.raises(ConfigError, match=r"'rollout.environment_args' = '\{\}x': is read only by"):
        validate_rollout(
            RolloutConfig(prompts="p.jsonl", reward="similarity", environment_args="{}x"),
            dp_size=1,
        )
    with pytest.raises(ConfigError, match=r"'rollout.environment_args' = '\[1\]': must be a JSON"):
        validate_rollout(RolloutConfig(environment=SINGLE, environment_args="[1]"), dp_size=1)
    with pytest.raises(ConfigError, match=r"'rollout.environment' = 'verifiers': name the taskset"):
        validate_rollout(RolloutConfig(environment="verifiers"), dp_size=1)


@pytest.mark.verifiers
def test_a_single_turn_taskset_gives_its_prompts_and_its_rubrics_rewards(tokenizer):
    environment = verifiers_env(SINGLE, '{"num_tasks": 3}')
    (source,) = environment.prompt_sources("train")
    records = source.records
    assert source.name == "tests.fnt.rollout.vf_single"
    assert environment.prompt_sources("val") == ()  # a taskset has no held-out split
    assert [r["messages"][-1]["content"] for r in records] == [
        "Reverse the word: stone",
        "Reverse the word: river",
        "Reverse the word: cloud",
    ]
    assert records[0]["messages"][0] == {
        "role": "system",
        "content": "Answer with the reversed word only.",
    }
    # Episode 0 of each group answers "enots", episode 1 "en ots1".
    episodes, samples, _, _ = episodes_of(
        environment, tokenizer, [("enots", "en ots1")], records[:1]
    )
    rubric = [1.0 * 1.0 + 0.5 * 1.0, 1.0 * 0.0 + 0.5 * (5 / 7)]  # exact (w 1), letters (w 0.5)
    assert [s.reward for s in samples] == pytest.approx(rubric)
    assert dict(samples[1].named_rewards) == pytest.approx(
        {"exact": 0.0, "letters": 5 / 7, "length": 7.0}  # the metric is logged with weight 0
    )
    assert environment.reward_weights == {"exact": 1.0, "letters": 0.5, "length": 0.0}
    assert all(s.turns == 1 and s.tool_calls == 0 for s in samples)


@pytest.mark.verifiers
def test_a_tool_taskset_runs_its_tools_and_masks_their_output(tokenizer):
    environment = verifiers_env(TOOLS)
    record = environment.prompt_sources("train")[0].records[0]
    assert [s["function"]["name"] for s in environment.start(record).tools] == [
        "calc_add",
        "calc_fail",
    ]
    bad_call = '<tool_call>{"name": "calc_fail", "arguments": {"reason": "x"}}</tool_call>'
    episodes, samples, _, _ = episodes_of(
        environment,
        tokenizer,
        [(TOOL_CALL, bad_call), ("42", "41")],
        [record],
        max_new_tokens=256,
        max_episode_tokens=4096,
    )
    good, failed = episodes[0]
    assert good.messages[-2] == {"role": "tool", "name": "calc_add", "content": "42"}
    assert "failed: x" in failed.messages[-2]["content"]
    assert [(s.tool_calls, s.tool_errors, s.turns) for s in samples] == [(1, 0, 2), (1, 1, 2)]
    # The rubric: correct (w 1), used_tool (w 0.25; a failed call is a call too), digits (w 0.1).
    assert [s.reward for s in samples] == pytest.approx([1.35, 0.35])
    assert dict(samples[1].named_rewards) == {"correct": 0.0, "used_tool": 1.0, "digits": 1.0}
    # Trained = sampled: the two turns' tokens; the tool's reply between them is masked.
    sample = samples[0]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [stop]
    answer = tokenizer("42", add_special_tokens=False)["input_ids"] + [stop]
    start = len(good.prompt.token_ids)
    reply = reply_ids(
        tokenizer,
        good.messages[: len(record["messages"]) + 1],
        good.prompt.tools,
        good.messages[-2:-1],
        turn,
    )
    assert list(sample.token_ids[start:]) == turn + reply + answer
    mask = [True] * len(turn) + [False] * len(reply) + [True] * len(answer)
    assert list(sample.sampled[start:]) == mask
    assert not any(sample.sampled[:start])


@pytest.mark.verifiers
@pytest.mark.parametrize("name", [SINGLE, TOOLS])
def test_the_in_process_engine_samples_and_trains_a_verifiers_taskset(policy_dir, name):
    config = rl_config(policy_dir, "", environment=name, max_turns=2, max_new_tokens=8)
    config = dataclasses.replace(config, seq_len=256, batch_size=16)
    state = rl_state(config)
    engine = state.handles.rollouts
    assert [p.record["vf_task"] for p in engine.prompts] == list(range(len(engine.prompts)))
    batch = engine.rollout(state)
    assert batch.metrics["rollout/episodes"] == 16
    names = ("exact", "letters") if name == SINGLE else ("correct", "used_tool")
    for reward in names:
        assert math.isfinite(batch.metrics[f"reward/{reward}/mean"])
    check_logprobs_match(batch, state.handles.model, 1.0)
