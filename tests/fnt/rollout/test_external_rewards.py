"""The external protocol's reward-only samples: fnt computes the group-relative advantages (by
'group', or consecutive runs of rollout.group_size lines) from the whole file, and every way of
giving them wrong is a located error."""

from __future__ import annotations

import json
import types

import pytest

from fnt.config import RolloutConfig
from fnt.distributed.runtime import setup_trainer
from fnt.errors import DataError
from fnt.rollout.advantages import group_advantages
from fnt.rollout.engines.external import (
    ExternalRollouts,
    rank_samples,
    read_rollouts,
    rollout_dir,
)
from fnt.state import Progress

from .test_external_samples import external_config, write_step


def single(reward, **fields) -> str:
    return json.dumps({"prompt_ids": [1, 2], "completion_ids": [3, 4], "reward": reward, **fields})


def flat(reward, **fields) -> str:
    record = {"token_ids": [1, 2, 3, 4, 5], "mask": [0, 0, 1, 0, 1], "reward": reward}
    return json.dumps({**record, **fields})


def advantages_of(tmp_path, lines, **rollout) -> list[float]:
    write_step(tmp_path, lines)
    samples, *_ = read_rollouts(rollout_dir(str(tmp_path), 1), RolloutConfig(**rollout))
    return [s.advantage for s in samples]


def expected(rewards, std_normalize=True) -> list[float]:
    return group_advantages([rewards], std_normalize=std_normalize)[0].tolist()


@pytest.mark.parametrize("std_normalize", [True, False])
def test_consecutive_lines_of_group_size_get_their_groups_advantages(tmp_path, std_normalize):
    # Both forms; the third group's equal rewards carry no signal: exactly 0.
    rewards = [1.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.5, 0.5]
    lines = [(flat if i % 2 else single)(r) for i, r in enumerate(rewards)]
    got = advantages_of(tmp_path, lines, group_size=3, std_normalize=std_normalize)
    want = [a for i in (0, 3, 6) for a in expected(rewards[i : i + 3], std_normalize)]
    assert got == want and got[6:] == [0.0, 0.0, 0.0] and got[0] != 0.0


def test_lines_with_a_group_key_form_groups_of_any_size_in_any_order(tmp_path):
    rows = [("a", 1.0), (7, 0.5), ("a", 0.0), (7, 0.0), ("a", 0.5), (7, 1.0), ("b", 0.3)]
    lines = [single(r, group=g) for g, r in rows]
    got = advantages_of(tmp_path, lines, group_size=4)
    a, seven = expected([1.0, 0.0, 0.5]), expected([0.5, 0.0, 1.0])
    assert got == [a[0], seven[0], a[1], seven[1], a[2], seven[2], 0.0]


def test_given_advantages_are_kept_and_the_reward_only_reported(tmp_path):
    lines = [single(1.0, advantage=0.25), single(0.0, advantage=-2.0)]
    assert advantages_of(tmp_path, lines, group_size=2) == [0.25, -2.0]


def test_the_advantages_come_from_the_whole_file_before_the_rank_split(tmp_path):
    rewards = [1.0, 0.0, 0.0, 0.0]
    write_step(tmp_path, [single(r) for r in rewards])
    samples, *_ = read_rollouts(rollout_dir(str(tmp_path), 1), RolloutConfig(group_size=4))
    # One group over both ranks' shares: each rank's advantages are those of the four rewards.
    shares = [rank_samples(samples, r, 2, "f") for r in (0, 1)]
    assert [s.advantage for share in shares for s in share] == expected(rewards)


@pytest.mark.parametrize(
    "lines, group_size, message",
    [
        (
            [single(1.0), single(0.0, advantage=1.0)],
            2,
            r"line 2 gives an 'advantage', but line 1 does not \(either every line",
        ),
        (
            [single(1.0, advantage=1.0), single(0.0), single(0.0)],
            1,
            r"line 2 gives no 'advantage', but line 1 does \(either every line",
        ),
        ([single(1.0), single(0.0), single(0.5)], 2, r"3 reward-only samples without 'group' "),
        ([single(1.0, group="g"), single(0.0)], 2, r"line 2: no 'group', but other lines give"),
        ([single(1.0, group=[1]), single(0.0)], 2, r"line 1: 'group' must be a string or an int"),
        ([single(float("nan")), single(0.0)], 2, r"line 1: 'reward' must be a finite number"),
        # Finite rewards whose advantage overflows float32 (without std_normalize, below).
        ([single(0.0), single(1e39)], 2, r"line 1: the advantage fnt computes from its 'reward'"),
        (
            [json.dumps({"prompt_ids": [1], "completion_ids": [2]})],
            1,
            r"line 1: missing 'advantage' \(or 'reward', for fnt",
        ),
    ],
)
def test_each_wrong_way_to_give_rewards_is_a_located_error(tmp_path, lines, group_size, message):
    with pytest.raises(DataError, match=r"step_1/samples.jsonl(, line \d+)?:? ?.*" + message):
        advantages_of(tmp_path, lines, group_size=group_size, std_normalize=False)


def test_the_engine_trains_reward_only_samples_with_the_computed_advantages(
    tiny_model_dir, tmp_path
):
    config = external_config(tiny_model_dir, tmp_path)
    assert config.rollout.group_size == 4 and config.rollout.std_normalize
    rewards = [1.0, 0.0, 0.5, 0.0]
    write_step(tmp_path, [flat(r) if i < 2 else single(r) for i, r in enumerate(rewards)])
    batch = ExternalRollouts(config, setup_trainer(config)).rollout(
        types.SimpleNamespace(progress=Progress())
    )
    trained = []
    for mb in batch.micro_batches:
        mb.check()
        trained += sorted(set(mb.advantages[mb.rows.loss_mask].tolist()))
    assert sorted(trained) == sorted(expected(rewards))
    assert batch.metrics["reward/mean"] == pytest.approx(sum(rewards) / 4)
