"""The pooled environment (fnt.rollout.environments.pooled): a crash, a segfault, a hang, an
infinite loop and a blown memory limit in a worker each cost only their episode, counted in
rollout/env_failures; a healthy pooled environment gives exactly the in-process samples."""

from __future__ import annotations

import pytest

from examples.sandbox.environment import build as sandbox
from fnt.errors import UserCodeError
from fnt.rollout.base import episode_metrics, episode_sums
from fnt.rollout.environments.pooled import PooledEnvironment
from fnt.rollout.saved_samples import sample_record

from .pooled_env import Misbehaving
from .test_environments import episodes_of

RECORDS = [{"prompt": "Print 6 times 7.", "answer": "42"}, {"prompt": "Print 2+2.", "answer": "4"}]


def program(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```"


@pytest.fixture
def pool():
    made = []

    def make(factory, **settings):
        made.append(PooledEnvironment(factory, None, **settings))
        return made[-1]

    yield make
    for environment in made:
        environment.close()


def test_a_healthy_pooled_sandbox_gives_exactly_the_in_process_samples(tokenizer, pool):
    texts = [(program("print(6 * 7)"), program("print(4)"), program("print(1 / 0)"))]
    in_process = episodes_of(sandbox(None), tokenizer, texts, RECORDS, group_size=3)[1]
    pooled = pool("examples.sandbox.environment:build", workers=2, timeout_s=30.0)
    samples = episodes_of(pooled, tokenizer, texts, RECORDS, group_size=3)[1]
    assert samples == in_process
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert pooled.failures == 0


def test_a_crash_a_hang_and_a_loop_in_the_sandbox_cost_only_their_episodes(tokenizer, pool):
    texts = [
        (
            program("print(6 * 7)"),
            program("import os\nos._exit(1)"),
            program("import time\ntime.sleep(600)"),
            program("while True:\n    pass"),
            program("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"),
        )
    ]
    sandboxed = pool("examples.sandbox.environment:build", workers=1, timeout_s=1.0)
    run = episodes_of(sandboxed, tokenizer, texts, RECORDS[:1], group_size=5, max_new_tokens=256)
    samples = run[1]
    assert not any(s.truncated for s in samples)
    assert [s.env_failed for s in samples] == [False, True, True, True, True]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert samples[0].advantage > 0 > samples[1].advantage  # the group still trains
    assert episode_metrics(episode_sums(samples))["rollout/env_failures"] == 4.0
    assert sandboxed.failures == 4
    # The replaced worker serves the next episodes.
    again = episodes_of(sandboxed, tokenizer, [(program("print(4)"),)], RECORDS[1:], group_size=2)
    assert [s.reward for s in again[1]] == [1.0, 1.0]


def test_a_failed_reply_ends_the_episode_at_the_failure_reward_without_scoring(tokenizer, pool):
    env = pool("tests.fnt.rollout.pooled_env:build", timeout_s=1.0, failure_reward=-1.0)
    texts = [("good", "crash", "hang"), "good"]
    episodes, samples, _, _ = episodes_of(env, tokenizer, texts, RECORDS[:1], group_size=3)
    assert [e.turns for e in episodes[0]] == [2, 1, 1]
    assert [s.env_failed for s in samples] == [False, True, True]
    assert [s.reward for s in samples] == [1.0, -1.0, -1.0]
    assert episode_metrics(episode_sums(samples))["rollout/env_failures"] == 2.0
    # The saved samples say which episodes failed.
    assert sample_record(samples[1], tokenizer)["env_failed"] is True
    assert "env_failed" not in sample_record(samples[0], tokenizer)


def test_the_memory_limit_fails_only_the_episode_that_passed_it(tokenizer, pool):
    texts = [("alloc", "good"), "good"]
    limited = pool("tests.fnt.rollout.pooled_env:build", timeout_s=30.0, memory_mb=128)
    samples = episodes_of(limited, tokenizer, texts, RECORDS[:1])[1]
    assert [s.env_failed for s in samples] == [True, False]
    # Without the limit the same allocation succeeds and the episode goes on.
    unlimited = pool("tests.fnt.rollout.pooled_env:build", timeout_s=30.0)
    samples = episodes_of(unlimited, tokenizer, texts, RECORDS[:1])[1]
    assert [s.env_failed for s in samples] == [False, False]


def test_an_exception_in_the_environment_is_its_bug_and_stops_the_run(tokenizer, pool):
    env = pool("tests.fnt.rollout.pooled_env:build", timeout_s=30.0)
    with pytest.raises(UserCodeError, match="ValueError: the environment's own bug"):
        episodes_of(env, tokenizer, ["raise"], RECORDS[:1])
    assert env.failures == 0


def test_a_factory_that_raises_is_reported_when_the_pool_starts():
    with pytest.raises(RuntimeError, match="tests.fnt.rollout.pooled_env:nothing"):
        PooledEnvironment("tests.fnt.rollout.pooled_env:nothing", None)


def test_an_in_process_environment_that_fails_is_not_a_failure(tokenizer):
    # Misbehaving run in the trainer's process would kill it; a plain exception stays an error.
    with pytest.raises(UserCodeError, match="own bug"):
        episodes_of(Misbehaving(), tokenizer, ["raise"], RECORDS[:1])
