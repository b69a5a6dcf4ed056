"""rollout.filter_groups (DAPO's dynamic sampling) on the in-process engine and the tiny model:
groups without signal replaced by new prompts' groups, the rounds bounded and counted, the prompt
stream advanced so that a resumed run draws what an uninterrupted one would; off as before."""

from __future__ import annotations

import dataclasses

import pytest

from fnt.batch import DataPosition
from fnt.config import ConfigError, RolloutConfig, check_filter_groups
from fnt.rollout.base import has_signal
from fnt.rollout.pack import RolloutSample
from fnt.rollout.prompts import step_prompts
from fnt.sources import rl_source
from fnt.state import Progress

from .conftest import rl_config, rl_state
from .flat_reward import is_flat
from .test_engine import assert_same_batch

REWARDS = "tests.fnt.rollout.flat_reward"
FILTER_KEYS = {
    "rollout/filter_rounds",
    "rollout/filtered_groups",
    "rollout/filter_exhausted_groups",
}


def filtering_config(policy_dir, prompts_file, reward, **rollout):
    return rl_config(
        policy_dir,
        prompts_file,
        reward=f"{REWARDS}:{reward}",
        filter_groups=True,
        **rollout,
    )


def expected_rounds(engine, position, max_rounds, flat):
    """The rule, for one rank: each round draws as many prompts as groups are missing; the
    last round's groups all stay. (rounds, filtered, exhausted, position after)."""
    need, rounds, filtered = engine.config.rollout.prompts_per_step, 0, 0
    while need:
        rounds += 1
        ids, position = step_prompts(engine.order, position, need)
        without_signal = sum(flat(engine.prompts[i].record) for i in ids)
        if rounds == max_rounds:
            return rounds, filtered, without_signal, position
        filtered += without_signal
        need = without_signal
    return rounds, filtered, 0, position


def test_a_group_has_a_signal_when_any_advantage_it_trains_on_is_not_zero():
    def sample(advantage, token_advantages=None):
        return RolloutSample(
            token_ids=(5, 6, 7),
            sampled=(False, True, True),
            logprobs=(0.0, -1.0, -1.0),
            reward=1.0,
            advantage=advantage,
            token_advantages=token_advantages,
        )

    assert not has_signal([sample(0.0), sample(0.0)])
    assert not has_signal([])
    assert has_signal([sample(0.0), sample(-0.5)])
    # Per-turn credit (rollout.credit = "turn"): the tokens' advantages are what trains.
    assert has_signal([sample(0.0, (0.0, 0.0, 0.25)), sample(0.0, (0.0, 0.0, 0.0))])
    assert not has_signal([sample(0.0, (0.0, 0.0, 0.0)), sample(0.0, (0.0, 0.0, 0.0))])


def groups_of(samples, size):
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def test_flat_groups_are_replaced_until_the_step_has_its_groups(policy_dir, prompts_file):
    config = filtering_config(policy_dir, prompts_file, "every_third", filter_max_rounds=8)
    state = rl_state(config)
    engine = state.handles.rollouts
    position = DataPosition()
    for step in (1, 2, 3):
        want = expected_rounds(engine, position, 8, is_flat)
        assert want[1] > 0 or step > 1  # the first step has a flat prompt to replace
        samples, dropped, after, metrics = engine.filtered_sample(engine.model, step, position, 0)
        assert dropped == 0
        assert len(samples) == 4 * 4
        groups = groups_of(samples, 4)
        assert all(has_signal(g) for g in groups)
        assert all(s.reward != 1.0 for s in samples)  # no flat prompt's completion is left
        assert (
            metrics["rollout/filter_rounds"],
            metrics["rollout/filtered_groups"],
            metrics["rollout/filter_exhausted_groups"],
            after,
        ) == want
        position = after


def test_when_the_rounds_run_out_the_last_rounds_groups_train_and_are_counted(
    policy_dir, prompts_file
):
    config = filtering_config(policy_dir, prompts_file, "nowhere", filter_max_rounds=3)
    state = rl_state(config)
    batch = rl_source(state)
    assert batch.metrics["rollout/filter_rounds"] == 3.0
    assert batch.metrics["rollout/filtered_groups"] == 8.0  # rounds 1 and 2: 4 groups each
    assert batch.metrics["rollout/filter_exhausted_groups"] == 4.0
    assert batch.num_samples == 4 * 4  # the batch is full, of groups without signal
    _, after = step_prompts(state.handles.rollouts.order, DataPosition(), 12)
    assert batch.data_after == after  # three rounds of 4 prompts were drawn
    for mb in batch.micro_batches:
        assert not mb.advantages.any()


def test_filtering_with_nothing_to_filter_gives_the_unfiltered_batch(policy_dir, prompts_file):
    off = rl_source(rl_state(rl_config(policy_dir, prompts_file, reward=f"{REWARDS}:everywhere")))
    on = rl_source(rl_state(filtering_config(policy_dir, prompts_file, "everywhere")))
    assert not FILTER_KEYS & off.metrics.keys()
    assert on.metrics["rollout/filter_rounds"] == 1.0
    assert on.metrics["rollout/filtered_groups"] == 0.0
    assert on.metrics["rollout/filter_exhausted_groups"] == 0.0
    without = dataclasses.replace(on, metrics={k: on.metrics[k] for k in off.metrics})
    assert_same_batch(off, without)


def test_a_resumed_stream_draws_the_prompts_and_samples_of_the_uninterrupted_one(
    policy_dir, prompts_file
):
    config = filtering_config(policy_dir, prompts_file, "every_third")
    state = rl_state(config)
    first = rl_source(state)
    second = rl_source(state.advance(data=first.data_after))
    assert first.metrics["rollout/filtered_groups"] > 0  # the first step filtered
    # A fresh engine at the checkpoint of step 1 (same weights) draws what the stream drew.
    fresh = rl_state(config)
    resumed = dataclasses.replace(fresh, progress=Progress(step=1, data=first.data_after))
    assert_same_batch(fresh.handles.rollouts.rollout(resumed), second)


def test_multi_turn_episodes_are_filtered_and_resume_alike(policy_dir, prompts_file):
    config = rl_config(
        policy_dir,
        prompts_file,
        reward="",
        environment=f"{REWARDS}:feedback_every_third",
        max_turns=3,
        filter_groups=True,
    )
    state = rl_state(config)
    engine = state.handles.rollouts
    samples, _, after, metrics = engine.filtered_sample(engine.model, 1, DataPosition(), 0)
    assert metrics["rollout/filtered_groups"] > 0
    assert all(has_signal(g) for g in groups_of(samples, 4))
    assert any(s.turns > 1 for s in samples)
    first = rl_source(state)
    assert first.data_after == after
    second = rl_source(state.advance(data=first.data_after))
    fresh = rl_state(config)
    resumed = dataclasses.replace(fresh, progress=Progress(step=1, data=first.data_after))
    assert_same_batch(fresh.handles.rollouts.rollout(resumed), second)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(async_level=1), "'rollout.filter_groups' = True: needs rollout.async_level = 0"),
        (dict(engine="vllm"), "'rollout.filter_groups' = True: the vllm engine cannot filter"),
        (dict(engine="external"), "the external engine cannot filter groups"),
        (dict(filter_max_rounds=1), "'rollout.filter_max_rounds' = 1: must be at least 2"),
        (dict(group_size=1), "'rollout.filter_groups' = True: needs rollout.group_size >= 2"),
    ],
)
def test_filter_settings_that_cannot_run_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_filter_groups(RolloutConfig(filter_groups=True, **settings))
    if "filter_max_rounds" not in settings:  # off, the same settings are fine
        check_filter_groups(RolloutConfig(**settings))
