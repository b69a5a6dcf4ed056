"""The environment behind HTTP (fnt.rollout.environments.served): the client over a server in
a thread gives exactly the in-process samples; a failed call in the server's worker pool costs
only its episode; the environment's own error stops the run."""

from __future__ import annotations

import threading

import pytest

from examples.sandbox.environment import build as sandbox
from fnt.errors import UserCodeError
from fnt.rollout.environments import FeedbackEnvironment, ToolEnvironment
from fnt.rollout.environments.episodes import run_episodes, scored_samples
from fnt.rollout.environments.pooled import PooledEnvironment
from fnt.rollout.environments.served import ServedEnvironment, main, make_server
from fnt.rollout.rewards import ascii_letters

from .multi_turn_env import add, broken
from .pooled_env import Misbehaving
from .test_environments import Scripted, episodes_of, prompt_of, rules
from .test_pooled import RECORDS, program


@pytest.fixture
def serve():
    servers = []

    def start(environment):
        server = make_server(environment, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "make, texts, expected",
    [
        (lambda: sandbox(None), [(program("print(6 * 7)"), program("print(1 / 0)"))], (4, 0)),
        (lambda: FeedbackEnvironment(ascii_letters, threshold=0.95), ["ab1", "abc"], (8, 0)),
        (
            lambda: ToolEnvironment([add, broken], ascii_letters, system="Use the tools."),
            ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "ok"],
            (8, 4),
        ),
    ],
    ids=["sandbox", "feedback", "tools"],
)
def test_a_served_environment_gives_exactly_the_in_process_samples(
    tokenizer, serve, make, texts, expected
):
    in_process = episodes_of(make(), tokenizer, texts, RECORDS, max_new_tokens=512)
    client = ServedEnvironment(serve(make()))
    served = episodes_of(client, tokenizer, texts, RECORDS, max_new_tokens=512)
    assert served[1] == in_process[1]
    counts = sum(s.turns for s in served[1]), sum(s.tool_calls for s in served[1])
    assert counts == expected  # (turns, tool calls): the multi-turn cases did go on
    assert [e.messages for g in served[0] for e in g] == [
        e.messages for g in in_process[0] for e in g
    ]


def test_a_crash_in_the_servers_pool_costs_only_its_episode(tokenizer, serve):
    pool = PooledEnvironment("tests.fnt.rollout.pooled_env:build", None, timeout_s=30.0)
    try:
        client = ServedEnvironment(serve(pool), failure_reward=-1.0)
        samples = episodes_of(client, tokenizer, [("good", "crash"), "good"], RECORDS[:1])[1]
    finally:
        pool.close()
    assert [s.env_failed for s in samples] == [False, True]
    assert [s.reward for s in samples] == [1.0, -1.0]


def test_the_environments_own_error_stops_the_run(tokenizer, serve):
    client = ServedEnvironment(serve(Misbehaving()))
    with pytest.raises(UserCodeError, match="ValueError: the environment's own bug"):
        episodes_of(client, tokenizer, ["raise"], RECORDS[:1])


def test_a_server_that_stops_answering_fails_the_call_not_the_run(tokenizer, serve):
    url = serve(sandbox(None))
    client = ServedEnvironment(url)
    prompt_episodes = episodes_of(client, tokenizer, [(program("print(42)"),)], RECORDS[:1])
    assert [s.env_failed for s in prompt_episodes[1]] == [False, False]
    client.url = "http://127.0.0.1:9"  # nothing listens on the discard port
    assert client.failure_reward == 0.0
    samples = scored_after_stop(client, tokenizer)
    assert [s.env_failed for s in samples] == [True, True]


def scored_after_stop(client, tokenizer):
    """The episodes of a prompt whose later calls all fail (the prompt renders in process)."""
    prompts = [prompt_of(RECORDS[0], sandbox(None), tokenizer)]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    episodes = run_episodes(prompts, Scripted(tokenizer, ["x"], stop), client, tokenizer, rules())
    return scored_samples(episodes, client, rules())[0]


def test_the_server_command_names_a_factory_it_cannot_import():
    with pytest.raises(SystemExit) as stopped:
        main(["--factory", "no_such_module_here:build", "--port", "0"])
    assert stopped.value.code == 2
