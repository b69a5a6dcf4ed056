"""Held-out validation of an environment mixture (rollout.environments): each member's held-out
prompts (its entry's val_prompts) run as whole episodes by its own environment, and reported as
val/{name}/* beside the overall val/*; what goes wrong names the member; the config's checks.

The members score by their records alone, whatever the model writes, so every value is a hand
computation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fnt.apps.inspect import default_keys
from fnt.config import ConfigError, ValConfig
from fnt.config.modes import has_val_data
from fnt.config.schema import MixtureEntryConfig
from fnt.config.validation import validate_val
from fnt.evaluation import Evaluation
from fnt.obs.monitors.console import console_line
from fnt.rollout.environments import Reply, Start

from .conftest import rl_config, rl_state

K = 2


class Twice:
    """Answers the first model turn with "again" and ends the episode after the second (or
    after a turn cut at max_new_tokens); scores the record's value."""

    def start(self, record):
        assert "value" in record or "prompt" in record  # a held-out or a training record
        return Start(({"role": "user", "content": "count to three"},))

    def respond(self, record, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return Reply(({"role": "user", "content": "again"},)) if turns < 2 else None

    def score(self, record, messages):
        return record.get("value", 0.0)


class Once:
    """One turn; scores 1 (a pass) for a record with "pass", NaN for one with "nan", as the
    named reward "correct"."""

    reward_weights = {"correct": 1.0}

    def start(self, record):
        assert "value" not in record  # a record of the other member fails loudly
        return Start(({"role": "user", "content": "say yes"},))

    def respond(self, record, messages):
        return None

    def score(self, record, messages):
        return {"correct": math.nan if record.get("nan") else float(record.get("pass", False))}


def twice(rollout):
    return Twice()


def once(rollout):
    return Once()


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def mixture_config(policy_dir, prompts_file, tmp_path, once_records=None, **val):
    twice_val = write(tmp_path / "twice_val.jsonl", [{"value": 0.2}, {"value": 0.6}])
    once_records = once_records or [{"pass": True}, {}, {}]
    once_val = write(tmp_path / "once_val.jsonl", once_records)
    module = "tests.fnt.rollout.test_mixture_val"
    entries = (
        MixtureEntryConfig(
            name="twice",
            environment=f"{module}:twice",
            prompts=str(prompts_file),
            val_prompts=twice_val,
        ),
        MixtureEntryConfig(
            name="once", environment=f"{module}:once", prompts=str(prompts_file), weight=2.0
        ),
        # A member without held-out prompts trains and is not validated.
        MixtureEntryConfig(name="plain", environment=f"{module}:once", prompts=str(prompts_file)),
    )
    entries = (entries[0], dataclasses.replace(entries[1], val_prompts=once_val), entries[2])
    config = rl_config(
        policy_dir, "", environments=entries, max_turns=3, max_new_tokens=4, temperature=0.7
    )
    settings = dict(interval=1, eval_on_start=True, samples=K, **val)
    return dataclasses.replace(config, seq_len=256, max_steps=1, val=ValConfig(**settings))


def test_each_member_is_validated_on_its_own_prompts(policy_dir, prompts_file, tmp_path):
    config = mixture_config(policy_dir, prompts_file, tmp_path)
    assert has_val_data(config)
    validate_val(config)
    state = rl_state(config)
    row = Evaluation(state).row_metrics(state)
    prefix = "val/start/"
    # twice: values 0.2 and 0.6, mean 0.4; none passes.
    assert row[prefix + "twice/reward/mean"] == pytest.approx(0.4, abs=1e-12)
    assert row[prefix + f"twice/reward/avg@{K}"] == pytest.approx(0.4, abs=1e-12)
    assert row[prefix + f"twice/reward/pass@{K}"] == 0.0
    # once: 1 of its 3 prompts scores 1, greedy or sampled.
    assert row[prefix + "once/reward/mean"] == pytest.approx(1 / 3, abs=1e-12)
    assert row[prefix + f"once/reward/avg@{K}"] == pytest.approx(1 / 3, abs=1e-12)
    assert row[prefix + f"once/reward/pass@{K}"] == pytest.approx(1 / 3, abs=1e-12)
    # Overall: every held-out prompt weighs the same, (0.2 + 0.6 + 1) / 5; 1 of 5 passes; the
    # greedy episodes' turns are 2, 2 (twice answered "again") and 1, 1, 1; the named reward is
    # renamed as in training.
    assert row[prefix + "reward/mean"] == pytest.approx(1.8 / 5, abs=1e-12)
    assert row[prefix + f"reward/avg@{K}"] == pytest.approx(1.8 / 5, abs=1e-12)
    assert row[prefix + f"reward/pass@{K}"] == pytest.approx(1 / 5, abs=1e-12)
    assert row[prefix + "reward/once/correct/mean"] == pytest.approx(1 / 3, abs=1e-12)
    assert row[prefix + "turns/mean"] == pytest.approx(7 / 5, abs=1e-12)
    assert row[prefix + "tool_calls/mean"] == 0.0
    member_keys = {
        f"{m}/reward/{k}" for m in ("twice", "once") for k in ("mean", "avg@2", "pass@2")
    }
    overall = {"reward/mean", "reward/avg@2", "reward/pass@2", "reward/once/correct/mean"}
    overall |= {"turns/mean", "tool_calls/mean"}
    assert set(row) == {prefix + key for key in member_keys | overall} | {"time/val"}
    # The console line shows each member's greedy reward; fnt plot draws every val/ key.
    line = console_line({"step": 1, **row}, max_steps=1, elapsed=1.0, steps_done=1)
    assert "val/start/twice 0.400 | val/start/once 0.333" in line
    assert {prefix + key for key in member_keys} <= set(default_keys(set(row)))
    # Each member's prompts keep their index among all the held-out prompts (their seeds).
    members = dict(state.handles.val.members)
    assert list(members) == ["twice", "once"]
    assert members["twice"].slots == (0, 1) and members["once"].slots == (2, 3, 4)


def test_a_bad_held_out_reward_names_the_member(policy_dir, prompts_file, tmp_path):
    config = mixture_config(policy_dir, prompts_file, tmp_path, once_records=[{}, {"nan": True}])
    state = rl_state(config)
    with pytest.raises(ValueError) as raised:
        Evaluation(state)
    message = str(raised.value)
    assert "reward 'once' returned nan" in message
    assert (
        "line 2 of the held-out prompts of 'once' (rollout.environments[1]: val_prompts" in message
    )


def test_the_config_checks_of_a_mixtures_held_out_prompts(policy_dir, prompts_file, tmp_path):
    from fnt.config import validate_rollout

    config = mixture_config(policy_dir, prompts_file, tmp_path)
    entries = config.rollout.environments
    # An entry named "start" would be validated as val/start/*, the start state's keys.
    named_start = (dataclasses.replace(entries[0], name="start"), *entries[1:])
    start = dataclasses.replace(config.rollout, environments=named_start)
    with pytest.raises(ConfigError, match=r"names an entry 'start'.*val/start/\*"):
        validate_val(dataclasses.replace(config, rollout=start))
    # A built-in that makes its own prompts makes its own held-out ones.
    gym = MixtureEntryConfig(name="gym", environment="reasoning_gym:gcd", val_prompts="v.jsonl")
    rollout = dataclasses.replace(config.rollout, environments=(*entries, gym))
    with pytest.raises(ConfigError, match=r"'rollout.environments\[3\].val_prompts' = 'v.jsonl'"):
        validate_rollout(rollout, dp_size=1)
    # Without val_prompts the members make no held-out prompts: nothing to validate.
    bare = tuple(dataclasses.replace(e, val_prompts="") for e in entries)
    assert not has_val_data(
        dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, environments=bare))
    )


def test_members_sample_as_the_whole_mixture_would_at_any_number_of_ranks(
    policy_dir, prompts_file, tmp_path
):
    # Two members scored by what the model writes: each member's sampled episodes are seeded by
    # its prompts' places among all the held-out prompts, so the members' sums add up to those
    # of all the prompts run together, and two ranks' shares to one rank's.
    import types

    from fnt.evaluation.held_out import sampled_episode_sums

    words = [["abc", "hello", "stop"], ["xyzzy", "ok", "tiny"]]
    entries = tuple(
        MixtureEntryConfig(
            name=name,
            environment="tests.fnt.rollout.multi_turn_env:lenient_feedback",
            prompts=str(prompts_file),
            val_prompts=write(tmp_path / f"{name}.jsonl", [{"prompt": f"say {w}"} for w in ws]),
        )
        for name, ws in zip(("a", "b"), words)
    )
    config = rl_config(
        policy_dir, "", environments=entries, max_turns=3, max_new_tokens=6, temperature=0.7
    )
    val = ValConfig(interval=1, samples=K)
    config = dataclasses.replace(config, seq_len=256, max_steps=1, val=val)
    state = rl_state(config)
    data, engine = state.handles.val, state.handles.rollouts
    engine.sync_weights_(state.handles.model)

    def sums(part, r=0, dp=1):
        runtime = types.SimpleNamespace(
            dp_rank=r, dims=types.SimpleNamespace(dp=dp), device="cpu", distributed=False
        )
        return sampled_episode_sums(engine, part, runtime, config, step=5)

    members = [sums(member) for _, member in data.members]
    together = sums(dataclasses.replace(data, members=()))
    assert [a + b for a, b in zip(*members)] == pytest.approx(together, abs=1e-12)
    assert together[1] == K * 6 and 0 < together[2] < 6  # some prompts pass, some do not
    for _, member in data.members:
        two = [a + b for a, b in zip(sums(member, 0, 2), sums(member, 1, 2))]
        assert two == pytest.approx(sums(member), abs=1e-12)
