"""reasoning-gym tasks as an environment (fnt.rollout.environments.tasks), with the real package:
prompts deterministic per seed, the task's own scorer as the reward, a held-out split disjoint
from the training prompts, tasks mixed by weight, and the one-line errors (a missing extra, an
unknown task, rejected settings)."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

import pytest

from fnt.apps.preflight import require_episodes
from fnt.batch import DataPosition
from fnt.config import ConfigError, RolloutConfig
from fnt.config.schema import ReasoningGymConfig, TaskConfig
from fnt.config.validation import validate_rollout
from fnt.rollout.environments import environment_of
from fnt.rollout.prompts import prompt_order, source_prompts, step_prompts

from .test_environments import episodes_of


@pytest.fixture
def reasoning_gym():
    """The real package, the tasks extra (which `make setup` installs with the dev one): imported
    here rather than at the top, so that the module collects where it is not installed (the GPU
    check's `pytest -m gpu` collects every module)."""
    return importlib.import_module("reasoning_gym")


def rollout(environment="reasoning_gym:spell_backward", **settings) -> RolloutConfig:
    return RolloutConfig(environment=environment, reasoning_gym=ReasoningGymConfig(**settings))


def train_records(config: RolloutConfig):
    environment, _ = environment_of(config)
    return [r for source in environment.prompt_sources("train") for r in source.records]


def test_prompts_are_reasoning_gyms_items_of_the_seed_and_the_same_every_time(reasoning_gym):
    first = train_records(rollout(seed=7, size=30))
    again = train_records(rollout(seed=7, size=30))
    other = train_records(rollout(seed=8, size=30))
    assert [r["question"] for r in first] == [r["question"] for r in again]
    assert [r["question"] for r in first] != [r["question"] for r in other]
    # Item i of the training split is reasoning-gym's item i of the dataset of seed 7.
    dataset = reasoning_gym.create_dataset("spell_backward", seed=7, size=30)
    assert [(r["question"], r["answer"]) for r in first] == [
        (dataset[i]["question"], dataset[i]["answer"]) for i in range(30)
    ]


@pytest.mark.parametrize("answer", ["text", "tag"])
def test_the_reward_is_the_tasks_own_score_of_the_extracted_answer(
    tokenizer, answer, reasoning_gym
):
    config = rollout(size=3, answer=answer)
    environment, _ = environment_of(config)
    records = train_records(config)
    truth = records[0]["answer"]
    replies = (truth, truth[:2] + "zz", "", f"  {truth.upper()} ")
    if answer == "tag":
        replies = (f"think <answer>{truth}</answer>", f"<answer>{truth[:2]}zz</answer>", truth, "")
    _, samples, _, _ = episodes_of(environment, tokenizer, (replies,), records, group_size=4)
    dataset = reasoning_gym.create_dataset("spell_backward", seed=0, size=3)
    groups = []
    for record_index in range(len(records)):
        item = dataset[record_index]
        # What reasoning-gym's scorer gives each reply's answer, extracted as documented.
        expected = []
        for reply in replies:
            if answer == "text":
                extracted = reply.strip() or None
            else:
                extracted = reasoning_gym.utils.extract_answer(reply)
            expected.append(dataset.score_answer(extracted, item))
        group = samples[4 * record_index : 4 * record_index + 4]
        assert [s.reward for s in group] == expected
        assert [s.named_rewards for s in group] == [(("spell_backward", e),) for e in expected]
        groups.append(expected)
    # The replies to the first record score 1, partly and 0: every kind of score was compared.
    assert groups[0][0] == 1.0 and 0 < groups[0][1] < 1 and groups[0][2] == 0.0


def test_the_held_out_split_comes_after_the_training_seeds_without_their_questions(
    reasoning_gym,
):
    # 3-letter words are few, so the held-out seeds repeat training questions that must go.
    settings = dict(seed=5, size=300, val_size=40)
    config = RolloutConfig(
        environment="reasoning_gym",
        reasoning_gym=ReasoningGymConfig(
            tasks=(TaskConfig("spell_backward", params=("min_word_len=3", "max_word_len=3")),),
            **settings,
        ),
    )
    environment, _ = environment_of(config)
    (train,) = environment.prompt_sources("train")
    (held_out,) = environment.prompt_sources("val")
    assert len(held_out.records) == 40
    trained = {r["question"] for r in train.records}
    questions = [r["question"] for r in held_out.records]
    assert not trained & set(questions) and len(set(questions)) == 40
    # They are reasoning-gym's items of seed 5 + 300, in order, some skipped.
    dataset = reasoning_gym.create_dataset(
        "spell_backward", seed=305, size=1000, min_word_len=3, max_word_len=3
    )
    indices = [r["index"] for r in held_out.records]
    assert questions == [dataset[i]["question"] for i in indices]
    assert indices != list(range(40)), "no training question was met: the test checks nothing"
    # The same every time.
    assert [r["question"] for r in environment.prompt_sources("val")[0].records] == questions


def test_tasks_mix_by_weight_and_each_reward_is_named_after_its_task(tokenizer):
    tasks = (
        TaskConfig("spell_backward", weight=3.0),
        TaskConfig("basic_arithmetic", params=("max_terms=2", "min_terms=2")),
    )
    config = RolloutConfig(
        environment="reasoning_gym",
        reasoning_gym=ReasoningGymConfig(tasks=tasks, size=40, answer="text"),
    )
    environment, name = environment_of(config)
    prompts, sizes, weights = source_prompts(
        environment.prompt_sources("train"), tokenizer, environment.start, name
    )
    assert sizes == (40, 40) and weights == (3.0, 1.0)
    order = prompt_order(len(prompts), 0, sizes, weights)
    ids, _ = step_prompts(order, DataPosition(), 40)
    shares = Counter(prompts[i].record["task"] for i in ids)
    assert shares == {"spell_backward": 30, "basic_arithmetic": 10}
    record = prompts[ids[0]].record
    score = environment.score(record, [{"role": "assistant", "content": record["answer"]}])
    assert score == {record["task"]: 1.0}


def test_task_settings_reach_reasoning_gym():
    config = RolloutConfig(
        environment="reasoning_gym",
        reasoning_gym=ReasoningGymConfig(
            tasks=(TaskConfig("spell_backward", params=("min_word_len=9", "max_word_len=9")),),
            size=20,
        ),
    )
    assert {len(r["answer"]) for r in train_records(config)} == {9}


@pytest.mark.parametrize(
    "config, message",
    [
        (rollout("reasoning_gym:spell_backwards"), "did you mean 'spell_backward'"),
        (
            rollout(
                "reasoning_gym",
                tasks=(TaskConfig("spell_backward", params=("max_word_len=1",)),),
            ),
            "rollout.reasoning_gym.tasks[0]': reasoning-gym's 'spell_backward' rejects",
        ),
        (
            rollout("reasoning_gym", tasks=(TaskConfig("spell_backward", params=("colour=2",)),)),
            "rejects its settings {'colour': 2}",
        ),
    ],
)
def test_a_bad_task_or_setting_is_a_config_error_before_any_model(config, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        require_episodes(config)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(tasks=(TaskConfig("spell_backward"),)), "name them in one place"),
        (dict(size=0), "'rollout.reasoning_gym.size' = 0"),
        (dict(tasks=(TaskConfig("a"), TaskConfig("a"))), "names a task twice"),
    ],
)
def test_reasoning_gym_keys_are_checked_with_the_config(changes, message):
    environment = "reasoning_gym" if "tasks" in changes and len(changes["tasks"]) > 1 else None
    config = rollout(environment or "reasoning_gym:spell_backward", **changes)
    with pytest.raises(ConfigError, match=message):
        validate_rollout(config, dp_size=1)


def test_reasoning_gym_makes_the_prompts_so_rollout_prompts_stays_empty():
    config = RolloutConfig(environment="reasoning_gym:spell_backward", prompts="p.jsonl")
    with pytest.raises(ConfigError, match="leave rollout.prompts empty"):
        validate_rollout(config, dp_size=1)
    validate_rollout(rollout(), dp_size=1)  # no prompts file needed


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "reasoning_gym" else real(name, *a),
    )
    for check in (require_episodes, environment_of):
        with pytest.raises(ConfigError) as error:
            check(rollout())
        assert str(error.value) == (
            "'rollout.environment' = 'reasoning_gym:spell_backward' needs the reasoning_gym "
            "package, which is not installed: pip install 'fnt[tasks]'"
        )


def test_a_task_without_room_for_both_splits_is_refused_naming_it():
    config = rollout(
        "reasoning_gym",
        tasks=(TaskConfig("spell_backward", params=("min_word_len=3", "max_word_len=3")),),
        size=3000,
        val_size=3000,
    )
    environment, _ = environment_of(config)
    with pytest.raises(ConfigError, match=r"tasks\[0\]'.* made only \d+ held-out questions"):
        environment.prompt_sources("val")
