"""scripts/bench_rl_env.py, the long-tailed environment of `bench_rl.py --long-tail`: how many
turns an episode runs and how long each call takes are functions of the prompt record."""

from __future__ import annotations

import collections

import pytest

from scripts import bench_rl_env
from scripts.bench_rl_env import MAX_TURNS, TURN_WEIGHTS, call_latency, episode_turns, long_tail

RECORDS = [{"prompt": f"reverse: {i:05d}abc", "answer": f"cba{i:05d}"[::-1]} for i in range(4000)]


def test_turns_are_a_long_tailed_function_of_the_record():
    turns = [episode_turns(r) for r in RECORDS]
    assert turns == [episode_turns(dict(r)) for r in RECORDS]  # the record decides, nothing else
    counts = collections.Counter(turns)
    assert set(counts) == set(range(1, MAX_TURNS + 1))
    # Close to TURN_WEIGHTS: most episodes short, a few of 8 turns.
    for n, weight in enumerate(TURN_WEIGHTS, start=1):
        assert counts[n] / len(RECORDS) == pytest.approx(weight / sum(TURN_WEIGHTS), abs=0.02)
    assert counts[1] > counts[2] > counts[4] > counts[8] > 0


def test_respond_hints_until_the_records_turns_then_ends(monkeypatch):
    slept = []
    monkeypatch.setattr(bench_rl_env.time, "sleep", slept.append)
    env = long_tail(rollout=None)
    record = next(r for r in RECORDS if episode_turns(r) == 4)
    messages = list(env.start(record).messages)
    before = bench_rl_env.slept_seconds()
    for turn in range(1, 5):
        messages.append({"role": "assistant", "content": "wrong"})
        reply = env.respond(record, messages)
        if turn < 4:
            assert reply is not None and reply.messages[0]["role"] == "user"
            assert reply.messages[0]["content"].startswith("Not quite: it starts with")
            messages.extend(reply.messages)
        else:
            assert reply is None
    expected = [call_latency(record, turn, bench_rl_env.LATENCY_MS) for turn in range(1, 5)]
    assert slept == expected
    assert bench_rl_env.slept_seconds() - before == pytest.approx(sum(expected))
    assert env.score(record, messages)["final"] == 0.0


def test_latency_is_the_base_with_one_call_in_eight_slower():
    latencies = [call_latency(r, turn, 20) for r in RECORDS[:1000] for turn in (1, 2)]
    assert set(latencies) == {0.02, 0.02 * bench_rl_env.SLOW_FACTOR}
    slow = latencies.count(0.02 * bench_rl_env.SLOW_FACTOR) / len(latencies)
    assert slow == pytest.approx(1 / bench_rl_env.SLOW_ONE_IN, abs=0.03)
    assert call_latency(RECORDS[0], 1, 0) == 0.0
