"""rollout.isolation and served URLs: a run's config alone puts its environment out of the
trainer's process. A TOML config builds the pooled environment (a worker's crash costs only its
episode, counted), a URL builds the served one (its server's crash likewise), a mixture's members
are pooled alike, start-up tries a served environment on the first prompt, the pool answers
calls from several threads at once, the sandbox example's config runs it in limited workers,
and each wrong setting is one ConfigError naming its key."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from examples.sandbox.environment import build as sandbox
from fnt.apps.preflight import require_episodes, try_user_code
from fnt.config import RLConfig, load_config, validate
from fnt.config.schema import IsolationConfig
from fnt.errors import ConfigError, UserCodeError
from fnt.rollout.base import episode_metrics, episode_sums
from fnt.rollout.environments import MixtureEnvironment, environment_of
from fnt.rollout.environments.pooled import PooledEnvironment
from fnt.rollout.environments.served import ServedEnvironment

from .pooled_env import Misbehaving
from .test_environments import episodes_of
from .test_pooled import RECORDS, program
from .test_served import serve  # noqa: F401 - the fixture: a local server in a thread

ROOT = Path(__file__).resolve().parents[3]


def config_of(tmp_path, text: str) -> RLConfig:
    """The RL config of a TOML text over a tiny model and the sandbox prompts, validated."""
    path = tmp_path / "rl.toml"
    path.write_text(textwrap.dedent(text))
    config, _ = load_config(["--config", str(path)], RLConfig)
    validate(config, 1)
    return config


@pytest.fixture
def built():
    """environment_of's environments, closed after the test (their worker processes stop)."""
    made = []

    def build(rollout):
        environment, name = environment_of(rollout)
        made.append(environment)
        return environment, name

    yield build
    for environment in made:
        members = getattr(environment, "members", {environment: environment})
        for member in members.values():
            if callable(getattr(member, "close", None)):
                member.close()


@pytest.fixture(scope="module")
def sandbox_pool():
    """The pool examples/sandbox/rl.toml's config alone builds (2 workers, 10 s, 1 GiB)."""
    config, _ = load_config(["--config", str(ROOT / "examples/sandbox/rl.toml")], RLConfig)
    validate(config, 1)
    environment, _ = environment_of(config.rollout)
    yield config, environment
    environment.close()


def test_the_sandbox_examples_config_runs_it_in_two_limited_workers(sandbox_pool):
    config, environment = sandbox_pool
    assert isinstance(environment, PooledEnvironment)
    limits = (len(environment.workers), environment.timeout_s, environment.memory_mb)
    assert limits == (2, 10.0, 1024)
    messages = [{"role": "assistant", "text": program("print(sum(range(1, 101)))")}]
    assert environment.score({"answer": "5050"}, messages) == 1.0
    # Without the workers, the example refuses to run model-written code in the trainer.
    in_process = dataclasses.replace(config.rollout, isolation=IsolationConfig())
    with pytest.raises(UserCodeError, match=r"runs model-written code: run it in worker"):
        environment_of(in_process)


def test_the_start_up_trial_the_engine_and_the_evaluation_share_one_pool(monkeypatch):
    """A run builds its environment three times (preflight's trial, the engine, the held-out
    evaluation): its workers start once, and again only after the pool was closed."""
    config, _ = load_config(["--config", str(ROOT / "examples/sandbox/rl.toml")], RLConfig)
    isolation = dataclasses.replace(config.rollout.isolation, workers=1)  # not sandbox_pool's
    rollout = dataclasses.replace(config.rollout, isolation=isolation)
    started = []
    start = PooledEnvironment.__init__

    def counted(pool, *args, **kwargs):
        started.append(pool)
        start(pool, *args, **kwargs)

    monkeypatch.setattr(PooledEnvironment, "__init__", counted)
    try:
        try_user_code(rollout)
        engines, _ = environment_of(rollout)
        evaluations, _ = environment_of(rollout)
        assert started == [engines] and evaluations is engines and len(engines.workers) == 1
        engines.close()
        assert environment_of(rollout)[0] is started[1] and len(started) == 2
    finally:
        for pool in started:
            pool.close()


def test_a_config_alone_runs_the_environment_in_workers_and_a_crash_costs_its_episode(
    tokenizer, sandbox_pool
):
    _, environment = sandbox_pool
    failures = environment.failures
    texts = [(program("print(6 * 7)"), program("import os\nos._exit(1)"))]
    samples = episodes_of(environment, tokenizer, texts, RECORDS[:1], group_size=2)[1]
    assert [s.env_failed for s in samples] == [False, True]
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert episode_metrics(episode_sums(samples))["rollout/env_failures"] == 1.0
    assert environment.failures == failures + 1
    # The crashed worker was replaced: the next episodes run in both workers.
    texts = [(program("print(4)"),)]
    again = episodes_of(environment, tokenizer, texts, RECORDS[1:], group_size=2)[1]
    assert [s.reward for s in again] == [1.0, 1.0]


def test_a_config_alone_reaches_a_served_environment_and_a_crash_costs_its_episode(
    tmp_path,
    tokenizer,
    serve,  # noqa: F811
):
    pool = PooledEnvironment("tests.fnt.rollout.pooled_env:build", None, timeout_s=30.0)
    try:
        url = serve(pool)
        config = config_of(
            tmp_path,
            f"""
            [rollout]
            environment = "{url}"
            prompts = "examples/sandbox/prompts.jsonl"

            [rollout.isolation]
            timeout_s = 20
            failure_reward = -0.5
            """,
        )
        environment, name = environment_of(config.rollout)
        assert isinstance(environment, ServedEnvironment) and name == f"environment {url!r}"
        assert (environment.timeout_s, environment.failure_reward) == (20.0, -0.5)
        samples = episodes_of(environment, tokenizer, [("good", "crash"), "good"], RECORDS[:1])[1]
    finally:
        pool.close()
    assert [s.env_failed for s in samples] == [False, True]
    assert [s.reward for s in samples] == [1.0, -0.5]


def test_a_mixtures_members_run_in_workers_alike(tmp_path, built):
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    config = config_of(
        tmp_path,
        f"""
        [[rollout.environments]]
        name = "code"
        environment = "examples.sandbox.environment:build"
        prompts = "{prompts}"

        [[rollout.environments]]
        name = "chat"
        environment = "tests.fnt.rollout.pooled_env:build"
        prompts = "{prompts}"

        [rollout.isolation]
        workers = 1
        failure_reward = -1.0
        """,
    )
    mixture, _ = built(config.rollout)
    assert isinstance(mixture, MixtureEnvironment)
    assert [type(m).__name__ for m in mixture.members.values()] == ["PooledEnvironment"] * 2
    # What a member's failed episode is worth (the episodes ask the mixture).
    assert mixture.failure_reward == -1.0
    assert [m.failure_reward for m in mixture.members.values()] == [-1.0, -1.0]
    record = {"environment": "code", "record": RECORDS[0]}
    messages = [{"role": "assistant", "text": program("print(6 * 7)")}]
    assert mixture.score(record, messages) == 1.0


def test_the_pool_answers_calls_from_several_threads_each_its_own(sandbox_pool):
    _, pool = sandbox_pool
    failures = pool.failures
    # The odd cases' answers are wrong, so a call given another's answer scores wrong.
    cases = [(n, {"answer": str(n * n + n % 2)}) for n in range(12)]
    barrier = threading.Barrier(4)

    def score(case):
        n, record = case
        if n < 4:
            barrier.wait()  # four calls at once, more than the pool has workers
        return pool.score(record, [{"role": "assistant", "text": program(f"print({n}*{n})")}])

    with ThreadPoolExecutor(4) as threads:
        scores = list(threads.map(score, cases))
    assert scores == [1.0, 0.0] * 6
    assert pool.failures == failures


def test_start_up_tries_a_served_environment_on_the_first_prompt(tmp_path, serve):  # noqa: F811
    url = serve(Misbehaving())  # its score reads "text", which the trial turn lacks: it raises
    rollout = config_of(
        tmp_path,
        f"""
        [rollout]
        environment = "{url}"
        prompts = "examples/sandbox/prompts.jsonl"
        """,
    ).rollout
    require_episodes(rollout)  # the server answers /info
    with pytest.raises(UserCodeError, match=f"environment '{url}' failed on the prompt of line 1"):
        try_user_code(rollout)


def test_a_server_that_does_not_answer_is_a_config_error_at_start_up(tmp_path):
    rollout = config_of(
        tmp_path,
        """
        [rollout]
        environment = "http://127.0.0.1:9"
        prompts = "examples/sandbox/prompts.jsonl"
        """,
    ).rollout
    with pytest.raises(ConfigError, match="'rollout.environment' = 'http://127.0.0.1:9': the "):
        require_episodes(rollout)


def test_a_factory_that_raises_in_its_workers_is_one_user_code_error(tmp_path):
    rollout = config_of(
        tmp_path,
        """
        [rollout]
        environment = "tests.fnt.rollout.broken_factory:build"
        prompts = "examples/sandbox/prompts.jsonl"
        [rollout.isolation]
        workers = 1
        """,
    ).rollout
    with pytest.raises(UserCodeError, match=r"did not start in its worker processes.*no sandbox"):
        environment_of(rollout)


SANDBOX = """
[rollout]
environment = "examples.sandbox.environment:build"
prompts = "examples/sandbox/prompts.jsonl"
"""


@pytest.mark.parametrize(
    "text, message",
    [
        (SANDBOX + "[rollout.isolation]\nworkers = -1", r"'rollout.isolation.workers' = -1: must"),
        (
            SANDBOX + "[rollout.isolation]\nworkers = 1\ntimeout_s = 0",
            r"'rollout.isolation.timeout_s' = 0.0: must be > 0",
        ),
        (
            SANDBOX + "[rollout.isolation]\nworkers = 1\nmemory_mb = -5",
            r"'rollout.isolation.memory_mb' = -5: must be >= 0",
        ),
        (
            SANDBOX + "[rollout.isolation]\nworkers = 1\nfailure_reward = nan",
            r"'rollout.isolation.failure_reward' = nan: must be a finite number",
        ),
        # A limit that nothing applies: the environment runs in the trainer's process.
        (
            SANDBOX + "[rollout.isolation]\nmemory_mb = 512",
            r"'rollout.isolation.memory_mb' = 512: applies to an environment out of the",
        ),
        (
            SANDBOX + "[rollout.isolation]\ntimeout_s = 5",
            r"'rollout.isolation.timeout_s' = 5.0: applies to an environment out of the",
        ),
        (
            '[rollout]\nreward = "ascii_letters"\nprompts = "examples/sandbox/prompts.jsonl"\n'
            + "[rollout.isolation]\nworkers = 2",
            r"'rollout.isolation.workers' = 2: runs rollout.environment in worker processes",
        ),
        # A URL: the server runs the environment, so the pool and its memory limit are its own.
        (
            SANDBOX.replace("examples.sandbox.environment:build", "http://127.0.0.1:8765")
            + "[rollout.isolation]\nworkers = 2",
            r"'rollout.isolation.workers' = 2: rollout.environment = 'http://127.0.0.1:8765' is "
            r"served, so its server runs it: give the server --workers",
        ),
        (
            SANDBOX.replace("examples.sandbox.environment:build", "http://127.0.0.1:8765")
            + "[rollout.isolation]\nmemory_mb = 100",
            r"'rollout.isolation.memory_mb' = 100: .* give the server --memory-mb",
        ),
        (
            SANDBOX.replace("examples.sandbox.environment:build", "http://"),
            r"'rollout.environment' = 'http://': not an environment server's URL; expected "
            r"http://HOST:PORT",
        ),
        (
            SANDBOX.replace("examples.sandbox.environment:build", "https://host:port"),
            r"'rollout.environment' = 'https://host:port': not a server's URL \(Port could not",
        ),
        (
            SANDBOX.replace("examples.sandbox.environment:build", "http://host:8765/?x=1"),
            r"'rollout.environment' = 'http://host:8765/\?x=1': not an environment server's URL",
        ),
        # In a mixture the entry is named.
        (
            """
            [[rollout.environments]]
            name = "remote"
            environment = "http://127.0.0.1:8765"
            prompts = "examples/sandbox/prompts.jsonl"
            [rollout.isolation]
            workers = 1
            """,
            r"rollout.environments\[0\] \(remote\): 'rollout.isolation.workers' = 1: ",
        ),
    ],
    ids=[
        "negative-workers",
        "zero-timeout",
        "negative-memory",
        "nan-failure-reward",
        "memory-in-process",
        "timeout-in-process",
        "workers-without-environment",
        "url-and-workers",
        "url-and-memory",
        "url-without-host",
        "url-bad-port",
        "url-with-query",
        "mixture-url-and-workers",
    ],
)
def test_a_wrong_isolation_setting_is_one_config_error_naming_its_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as raised:
        config_of(tmp_path, text)
    assert "\n" not in str(raised.value)


def test_a_mixture_member_may_be_a_server(tmp_path, serve):  # noqa: F811
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    url = serve(sandbox(None))
    config = config_of(
        tmp_path,
        f"""
        [[rollout.environments]]
        name = "remote"
        environment = "{url}"
        prompts = "{prompts}"

        [[rollout.environments]]
        name = "local"
        environment = "examples.reverse_text.environments:feedback"
        prompts = "examples/debug/prompts.jsonl"

        [rollout.isolation]
        failure_reward = -1.0
        """,
    )
    mixture, _ = environment_of(config.rollout)
    remote, local = mixture.members.values()
    assert isinstance(remote, ServedEnvironment) and not isinstance(local, ServedEnvironment)
    assert mixture.failure_reward == remote.failure_reward == -1.0
    record = {"environment": "remote", "record": RECORDS[0]}
    assert mixture.score(record, [{"role": "assistant", "text": program("print(42)")}]) == 1.0
