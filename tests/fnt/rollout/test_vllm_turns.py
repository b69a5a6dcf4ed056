"""The vLLM engine's multi-turn episodes (`ServerTurns`) against two fake servers that answer
scripted tool calls: each later turn's prompt is the exact token ids so far (the previous prompt,
the sampled ids, the rendered reply), sent to the server the episode's prompt used; the samples
train exactly the tokens the servers sampled, with the servers' logprobs; the tool results are
context. The real server's multi-turn test is tests/e2e/test_vllm.py."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest

from fnt.config import VLLMConfig
from fnt.rollout.engines.vllm import VLLMEngine

from .conftest import rl_config, rl_state
from .test_vllm import FakeServer

CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CALL_BROKEN = '<tool_call>\n{"name": "broken", "arguments": {"x": "y"}}\n</tool_call>'
# Episode i of a group: calls add (2 turns), calls the raising tool (2 turns), or answers (1).
FIRST_TURNS = (CALL_ADD, CALL_BROKEN, "done")
# What the tiny model's template renders after a turn that called add, up to the next turn's prompt.
ADD_REPLY = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


class ScriptedVLLM:
    """The /v1/completions of a vLLM server, scripted: a prompt without a tool message gets
    FIRST_TURNS[i % 3] as choice i, one with a tool message gets "five"; every text ends with
    the stop token and token k of a choice has logprob -(k + 1) / 100. The weight-loading
    endpoints answer as a server's do. Records (server index, request body) of completions."""

    def __init__(self, tokenizer, stop_id: int) -> None:
        self.tokenizer, self.stop = tokenizer, stop_id
        self.completions: list[tuple[int, dict]] = []
        self.lock = threading.Lock()

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop]

    def answer_for(self, index: int):
        version = {"v": None}

        def answer(method, path, body):
            if path == "/v1/models":
                return 200, {"data": [{"id": "scripted"}]}
            if path == "/update_weight_version":
                version["v"] = body["new_version"]
            if path == "/weight_info":
                return 200, {"weight_version": version["v"]}
            if path != "/v1/completions":
                return 200, None
            with self.lock:
                self.completions.append((index, body))
            prompt = self.tokenizer.decode(body["prompt"])
            texts = (
                ["five"] * body["n"]
                if "<|im_start|>tool" in prompt
                else [FIRST_TURNS[i % 3] for i in range(body["n"])]
            )
            choices = []
            for i, text in enumerate(texts):
                ids = self.ids(text)[: body["max_tokens"]]
                logprobs = [-(k + 1) / 100 for k in range(len(ids))]
                choices.append(
                    {"index": i, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}
                )
            return 200, {"choices": choices}

        return answer


@pytest.fixture
def scripted_servers(tokenizer):
    script = ScriptedVLLM(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    servers = [FakeServer(script.answer_for(i)) for i in range(2)]
    yield script, servers
    for server in servers:
        server.close()


def expected_episodes(completions, tokenizer):
    """Every episode rebuilt from the servers' requests alone, as (token ids, sampled mask,
    logprobs at every position, turns, tool calls, tool errors): a first-turn request's prompt
    and one of its choices, then, where a later request's prompt continues those ids, that
    request's reply part and its answer. Checks on the way that a later turn's prompt is exactly
    the previous prompt + the sampled ids + the rendered tool reply, sent to the server of the
    first turn."""
    firsts = [(server, body) for server, body in completions if body["n"] > 1]
    laters = [(server, body) for server, body in completions if body["n"] == 1]
    script = ScriptedVLLM(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    episodes, continued = [], 0
    for server, body in firsts:
        for i in range(body["n"]):
            sampled = script.ids(FIRST_TURNS[i % 3])
            ids = body["prompt"] + sampled
            mask = [False] * len(body["prompt"]) + [True] * len(sampled)
            lps = [0.0] * len(body["prompt"]) + [-(k + 1) / 100 for k in range(len(sampled))]
            if i % 3 < 2:  # a tool call: the next turn continues exactly these ids
                (next_server, next_body), *rest = [
                    (s, b) for s, b in laters if b["prompt"][: len(ids)] == ids
                ]
                assert next_server == server  # the prompt's server holds its prefix cache
                reply = next_body["prompt"][len(ids) :]
                text = tokenizer.decode(reply)
                if i % 3 == 0:
                    assert text == ADD_REPLY
                else:
                    assert "error: broken raised RuntimeError" in text
                answer = script.ids("five")
                ids = next_body["prompt"] + answer
                mask += [False] * len(reply) + [True] * len(answer)
                lps += [0.0] * len(reply) + [-(k + 1) / 100 for k in range(len(answer))]
                continued += 1
            counts = ((2, 1, 0), (2, 1, 1), (1, 0, 0))[i % 3]
            episodes.append((ids, mask, lps, *counts))
    assert continued == len(laters)  # every later request continues one episode
    return episodes


def test_vllm_multi_turn_episodes_send_exact_ids_and_train_what_the_servers_sampled(
    policy_dir, prompts_file, tokenizer, scripted_servers, tmp_path, monkeypatch
):
    script, servers = scripted_servers
    config = rl_config(
        policy_dir,
        prompts_file,
        engine="vllm",
        environment="tests.fnt.rollout.multi_turn_env:tools",
        group_size=3,
        max_new_tokens=96,  # a byte-level tokenizer: a tool call is 71 tokens
        max_turns=3,
        vllm=VLLMConfig(urls=tuple(s.url for s in servers), retry_s=0.0),
    )
    config = dataclasses.replace(config, seq_len=512, batch_size=12, output_dir=str(tmp_path))
    state = rl_state(config)
    engine = state.handles.rollouts
    assert isinstance(engine, VLLMEngine)
    seen = []
    real_episodes = engine.episodes

    def keep(*args, **kwargs):
        samples, dropped = real_episodes(*args, **kwargs)
        seen.extend(samples)
        return samples, dropped

    monkeypatch.setattr(engine, "episodes", keep)
    try:
        engine.publish_(state)  # what the driver does before it asks for the rollouts
        batch = engine.rollout(state)
    finally:
        engine.close()

    # 4 prompts x 3 episodes: the first turn is one request per prompt (n = 3) on server
    # slot mod 2, the second one request per episode that called a tool (n = 1).
    assert sorted(b["n"] for _, b in script.completions) == [1] * 8 + [3] * 4
    assert sorted(s for s, b in script.completions if b["n"] == 3) == [0, 0, 1, 1]
    expected = expected_episodes(script.completions, tokenizer)
    got = [
        (list(s.token_ids), list(s.sampled), list(s.logprobs), s.turns, s.tool_calls, s.tool_errors)
        for s in seen
    ]
    assert sorted(map(repr, got)) == sorted(map(repr, expected))

    # The packed batch trains exactly the sampled tokens of every sample, nothing of the
    # prompts or the tool results.
    by_ids = {tuple(s.token_ids): s for s in seen}
    documents = 0
    for mb in batch.micro_batches:
        for r, lengths in enumerate(mb.sample_lengths):
            start = 0
            for length in lengths:
                ids = tuple(mb.rows.input_ids[r, start : start + length].tolist())
                mask = mb.rows.loss_mask[r, start : start + length].tolist()
                assert mask == list(by_ids[ids].sampled)
                start += length
                documents += 1
    assert documents == 12
    metrics = batch.metrics
    assert metrics["rollout/episodes"] == 12
    assert metrics["rollout/turns/mean"] == pytest.approx(5 / 3)
    assert metrics["rollout/tool_calls/mean"] == pytest.approx(2 / 3)
    assert metrics["rollout/tool_errors/mean"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("lockstep", [False, True])
def test_each_episodes_requests_go_on_their_own(policy_dir, prompts_file, tokenizer, lockstep):
    """The first request server 0 gets takes 0.5 s to answer. With episodes on their own, the
    other prompts' episodes send their second turns meanwhile; in lockstep none is sent before
    every first turn is answered."""
    script = ScriptedVLLM(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    times: list[tuple[int, float, float, bool]] = []  # (n, arrived, answered, slowed)
    lock = threading.Lock()

    def timed(index):
        answer = script.answer_for(index)

        def slow_once(method, path, body):
            arrived = time.monotonic()
            if path != "/v1/completions":
                return answer(method, path, body)
            with lock:
                slow = index == 0 and not any(slowed for *_, slowed in times)
                if slow:
                    times.append((body["n"], arrived, math.inf, True))
            if slow:
                time.sleep(0.5)
            out = answer(method, path, body)
            with lock:
                if slow:
                    times.remove((body["n"], arrived, math.inf, True))
                times.append((body["n"], arrived, time.monotonic(), slow))
            return out

        return slow_once

    servers = [FakeServer(timed(i)) for i in range(2)]
    config = rl_config(
        policy_dir,
        prompts_file,
        engine="vllm",
        environment="tests.fnt.rollout.multi_turn_env:tools",
        group_size=3,
        max_new_tokens=96,
        max_turns=3,
        lockstep=lockstep,
        vllm=VLLMConfig(urls=tuple(s.url for s in servers), retry_s=0.0),
    )
    state = rl_state(dataclasses.replace(config, seq_len=512, batch_size=12))
    engine = state.handles.rollouts
    try:
        engine.publish_(state)
        engine.rollout(state)
    finally:
        engine.close()
        for server in servers:
            server.close()
    [slow_answered] = [answered for *_, answered, slowed in times if slowed]
    second_turns_meanwhile = [a for n, a, _, _ in times if n == 1 and a < slow_answered]
    assert len(times) == 12
    assert (second_turns_meanwhile == []) == lockstep
