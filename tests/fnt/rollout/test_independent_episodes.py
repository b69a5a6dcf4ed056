"""Episodes that advance on their own (rollout.lockstep = false, the default): the in-process
engine's continuous batch samples what lockstep samples, whatever the environment's latency or
the order episodes finish in; a slow environment call holds only its own episode; async
environments run on fnt's event loop; what an environment raises still stops the run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fnt.errors import UserCodeError
from fnt.rollout.continuous import recorded_logprobs
from fnt.rollout.engines import in_process
from tests.fnt.rollout.conftest import rl_config, rl_state
from tests.fnt.rollout.test_engine import check_logprobs_match

ENV = "tests.fnt.rollout.{}"


def multi_turn_state(policy_dir, prompts_file, environment: str, **rollout):
    config = rl_config(
        policy_dir,
        prompts_file,
        environment=ENV.format(environment),
        max_turns=3,
        max_new_tokens=6,
        temperature=0.7,
        **rollout,
    )
    return rl_state(dataclasses.replace(config, seq_len=256, batch_size=16))


def same_samples(a, b) -> None:
    """Two RL batches hold the same samples: tokens and masks equal, logprobs within 1e-5 (a
    padded batched forward of other rows may differ in the last float bits)."""
    assert a.metrics["rollout/turns/mean"] == b.metrics["rollout/turns/mean"]
    assert a.metrics["reward/final/mean"] == b.metrics["reward/final/mean"]
    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
        assert torch.equal(x.rows.input_ids, y.rows.input_ids)
        assert torch.equal(x.rows.loss_mask, y.rows.loss_mask)
        torch.testing.assert_close(x.inference_logprobs, y.inference_logprobs, rtol=0, atol=1e-5)


def test_the_continuous_batch_samples_what_lockstep_samples(policy_dir, prompts_file, monkeypatch):
    state = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    engine = state.handles.rollouts
    monkeypatch.setattr(in_process, "generate", None)  # the stream decodes, never `generate`
    independent = engine.rollout(state)
    assert independent.metrics["rollout/turns/mean"] > 1
    assert independent.metrics["rollout/episodes"] == 16
    check_logprobs_match(independent, state.handles.model, 0.7)
    same_samples(independent, engine.rollout(state))  # the same state, the same episodes
    monkeypatch.undo()
    lockstep = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback", lockstep=True)
    same_samples(independent, lockstep.handles.rollouts.rollout(lockstep))


def test_an_episode_that_ends_lets_go_of_its_kv_cache_while_others_run(
    policy_dir, prompts_file, monkeypatch
):
    """Each ended episode's kept cache is freed when it ends, not at the end of the step: the
    caches kept never outnumber the episodes still running, and none is left at the end."""
    state = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    streams, excess = [], []
    ended = set()
    keep, end = in_process.ModelTurns._keep, in_process.ModelStream.end

    def watched_keep(turns, completion, slot, index):
        kept = keep(turns, completion, slot, index)
        excess.extend(k for k in turns.caches if k in ended)  # an ended episode's cache held
        return kept

    def watched_end(stream, slot, index):
        streams.append(stream)
        end(stream, slot, index)
        ended.add((slot, index))
        excess.extend(k for k in stream.turns.caches if k in ended)

    monkeypatch.setattr(in_process.ModelTurns, "_keep", watched_keep)
    monkeypatch.setattr(in_process.ModelStream, "end", watched_end)
    batch = state.handles.rollouts.rollout(state)
    assert batch.metrics["rollout/turns/mean"] > 1 and len(ended) == 16
    assert excess == [] and streams and streams[0].turns.caches == {}


def test_an_environment_with_random_latency_gives_the_samples_it_gives_without(
    policy_dir, prompts_file
):
    plain = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    jittery = multi_turn_state(policy_dir, prompts_file, "latency_env:jittery", env_concurrency=4)
    batch = jittery.handles.rollouts.rollout(jittery)
    calls = jittery.handles.rollouts.environment.calls
    assert len({turn for turn, *_ in calls}) > 1  # later turns were answered too
    same_samples(plain.handles.rollouts.rollout(plain), batch)


def test_a_slow_environment_call_holds_only_its_own_episode(policy_dir, prompts_file):
    """The first answer takes 0.6 s: the other episodes' later turns are sampled and answered
    meanwhile. In lockstep nothing else happens until it returns."""
    for lockstep in (False, True):
        state = multi_turn_state(
            policy_dir, prompts_file, "latency_env:one_slow_call", lockstep=lockstep
        )
        state.handles.rollouts.rollout(state)
        calls = state.handles.rollouts.environment.calls
        [(_, start, end, _)] = [call for call in calls if call[3] > 0]
        meanwhile = [t for t, s, e, _ in calls if start < s and e < end]
        if lockstep:
            assert meanwhile == []
        else:
            assert any(t >= 2 for t in meanwhile)  # another episode's second answer, in between


def test_an_async_environment_runs_on_the_event_loop_and_samples_the_same(policy_dir, prompts_file):
    plain = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    for lockstep in (False, True):
        state = multi_turn_state(
            policy_dir, prompts_file, "latency_env:async_feedback", lockstep=lockstep
        )
        same_samples(plain.handles.rollouts.rollout(plain), state.handles.rollouts.rollout(state))


def test_an_environment_that_raises_stops_the_rollout_with_its_message(
    policy_dir, prompts_file, monkeypatch
):
    state = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    environment = state.handles.rollouts.environment

    def broken(record, messages):
        raise RuntimeError("the sandbox is gone")

    monkeypatch.setattr(environment, "respond", broken)
    with pytest.raises(UserCodeError, match="failed to answer turn 1 on .*the sandbox is gone"):
        state.handles.rollouts.rollout(state)


def test_recorded_logprobs_come_from_the_finished_episodes(policy_dir, prompts_file):
    """Which turns shared a decoding batch depends on timing; the recorded logprobs do not:
    they are exactly those of forward passes of the step's finished samples, which equal a
    forward pass of each sample alone up to float rounding."""
    state = multi_turn_state(policy_dir, prompts_file, "latency_env:jittery")
    engine = state.handles.rollouts
    engine.sync_weights_(state.handles.model)
    samples, _, _ = engine.sample(engine.model, 1, state.progress.data, 0)
    assert any(s.turns > 1 for s in samples)
    sequences = [(s.token_ids, s.sampled) for s in samples]
    recorded = recorded_logprobs(engine.model, sequences, 0.7)
    for sample, values in zip(samples, recorded, strict=True):
        assert [lp for lp, sampled in zip(sample.logprobs, sample.sampled) if sampled] == values
        (alone,) = recorded_logprobs(engine.model, [(sample.token_ids, sample.sampled)], 0.7)
        torch.testing.assert_close(torch.tensor(values), torch.tensor(alone), rtol=0, atol=1e-5)


def test_recorded_logprobs_are_read_in_batches_of_a_token_budget(
    policy_dir, prompts_file, monkeypatch
):
    from fnt.rollout import continuous

    state = multi_turn_state(policy_dir, prompts_file, "multi_turn_env:feedback")
    engine = state.handles.rollouts
    sequences = [(tuple(range(1, 12 + n)), (False,) * 10 + (True,) * (1 + n)) for n in range(5)]
    whole = recorded_logprobs(engine.model, sequences, 1.0)
    monkeypatch.setattr(continuous, "RECORDING_TOKENS", 30)  # 2 of them at most a pass
    widths = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    parts = recorded_logprobs(engine.model, sequences, 1.0)
    assert widths == [(2, 12), (2, 14), (1, 15)]
    assert [len(v) for v in parts] == [1, 2, 3, 4, 5]
    for a, b in zip(whole, parts):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="first token cannot be sampled"):
        recorded_logprobs(engine.model, [((1, 2), (True, True))], 1.0)
