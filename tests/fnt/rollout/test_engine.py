"""The in-process engine on the tiny model: weight sync, rl_source, metrics, exact resume."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from fnt.batch import DataPosition, to_device
from fnt.config import ConfigError, validate_rollout
from fnt.distributed.runtime import setup_trainer
from fnt.errors import DataError
from fnt.loop import fold
from fnt.rollout import (
    Completion,
    InProcessEngine,
    generate,
    load_prompts,
    rollout_metrics,
)
from fnt.rollout.environments import SingleTurnEnvironment
from fnt.rollout.environments.episodes import (
    EpisodeRules,
    EpisodeSample,
    run_episodes,
    scored_samples,
)
from fnt.rollout.pack import ROW_MULTIPLE, single_turn
from fnt.rollout.rewards import score, similarity
from fnt.sources import rl_source
from fnt.state import Progress, StaleStateError
from fnt.update import packed_logits
from steps import rl_step

from .conftest import one_process_runtime, rl_config, rl_state, scale_weights_

METRICS = (
    "reward/mean",
    "reward/std",
    "time/rollout",
    "rollout/tokens_per_second",
    "rollout/completion_len/mean",
)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids.to(next(model.parameters()).device)).logits


def test_the_inference_copy_has_the_policys_logits_after_a_sync(policy_dir, prompts_file):
    config = rl_config(policy_dir, prompts_file)
    state = rl_state(config)
    policy, engine = state.handles.model, state.handles.rollouts
    assert isinstance(engine, InProcessEngine)
    assert not engine.model.training
    scale_weights_(policy, 1.1)
    ids = torch.arange(3, 40)[None]
    assert not torch.allclose(logits_of(engine.model, ids), logits_of(policy, ids))
    engine.sync_weights_(policy)
    torch.testing.assert_close(
        logits_of(engine.model, ids), logits_of(policy, ids), rtol=0, atol=1e-6
    )
    assert policy.training  # the sync leaves the live policy as it was


def check_logprobs_match(batch, policy, temperature: float, atol: float = 1e-5):
    """The recorded logprobs equal a fresh forward of `policy` over the packed rows."""
    for mb in batch.micro_batches:
        mb = to_device(mb, next(policy.parameters()).device)
        with torch.no_grad():
            logits = packed_logits(policy, mb.rows).float()
        logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
        fresh = logp.gather(-1, mb.rows.input_ids[:, 1:, None]).squeeze(-1)
        mask = mb.rows.loss_mask[:, 1:]
        torch.testing.assert_close(
            mb.inference_logprobs[:, 1:][mask], fresh[mask], rtol=0, atol=atol
        )


def completions_with_answers(batch, prompts, tokenizer):
    """(completion text, the prompt's record, advantage) of every packed document; the text as
    rewards read it: special tokens kept, the final stop token dropped."""
    records = {p.token_ids: p.record for p in prompts}
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    out = []
    for mb in batch.micro_batches:
        for r, lengths in enumerate(mb.sample_lengths):
            t = 0
            for length in lengths:
                ids, mask = (
                    mb.rows.input_ids[r, t : t + length],
                    mb.rows.loss_mask[r, t : t + length],
                )
                prompt = tuple(ids[~mask].tolist())
                sampled = ids[mask].tolist()
                if sampled and sampled[-1] in stops:
                    sampled = sampled[:-1]
                out.append(
                    (
                        tokenizer.decode(sampled),
                        records[prompt],
                        float(mb.advantages[r, t]),
                    )
                )
                t += length
    return out


def test_rl_source_gives_scored_packed_rollouts_step_after_step(
    policy_dir, prompts_file, tokenizer
):
    config = rl_config(policy_dir, prompts_file, temperature=0.8)
    state = rl_state(config)
    first = rl_source(state)
    # The policy changes between steps; the next rollout must use the changed weights.
    check_logprobs_match(first, state.handles.model, 0.8)
    state = state.advance(data=first.data_after)
    scale_weights_(state.handles.model, 1.05)
    second = rl_source(state)
    check_logprobs_match(second, state.handles.model, 0.8)

    prompts = load_prompts(prompts_file, tokenizer)
    for batch, after in ((first, DataPosition(0, 4)), (second, DataPosition(0, 8))):
        batch.check()
        assert batch.data_after == after
        # Rows fit the samples: as long as a micro-batch's longest sample, rounded up, within
        # the token budget of micro_batch_size rows of seq_len.
        for mb in batch.micro_batches:
            rows, row_len = mb.rows.input_ids.shape
            longest = max(max(lengths, default=0) for lengths in mb.sample_lengths)
            assert row_len == -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE < 128
            assert rows * row_len <= 2 * 128
        assert (
            batch.num_samples
            == 16
            == sum(len(x) for mb in batch.micro_batches for x in mb.sample_lengths)
        )
        assert set(METRICS) <= set(batch.metrics) and all(
            math.isfinite(v) for v in batch.metrics.values()
        )
        loss_tokens = sum(int(mb.rows.loss_mask.sum()) for mb in batch.micro_batches)
        assert batch.metrics["rollout/completion_len/mean"] == loss_tokens / 16
        assert batch.metrics["time/rollout"] > 0 and batch.metrics["rollout/tokens_per_second"] > 0
        assert all(bool((mb.temperatures == 0.8).all()) for mb in batch.micro_batches)
        # Rewards are scored on the completion text without its stop token; advantages per group.
        docs = completions_with_answers(batch, prompts, tokenizer)
        rewards = [similarity(text, record) for text, record, _ in docs]
        assert all("<|im_end|>" not in text for text, _, _ in docs)
        assert batch.metrics["reward/mean"] == pytest.approx(sum(rewards) / 16)
        assert len({record["id"] for _, record, _ in docs}) == 4
        for prompt_id in {record["id"] for _, record, _ in docs}:
            group = [adv for _, record, adv in docs if record["id"] == prompt_id]
            assert len(group) == 4 and abs(sum(group)) < 1e-4
    assert (
        first.micro_batches[0].rows.input_ids.tolist()
        != second.micro_batches[0].rows.input_ids.tolist()
    )


def assert_same_batch(a, b):
    assert a.data_after == b.data_after and a.num_samples == b.num_samples
    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
        assert x.sample_lengths == y.sample_lengths
        for name in ("input_ids", "position_ids", "document_ids", "loss_mask"):
            assert torch.equal(getattr(x.rows, name), getattr(y.rows, name)), name
        for name in ("advantages", "temperatures", "inference_logprobs"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    timeless = [k for k in a.metrics if k not in ("time/rollout", "rollout/tokens_per_second")]
    assert {k: a.metrics[k] for k in timeless} == {k: b.metrics[k] for k in timeless}


def test_resuming_the_stream_at_step_1_gives_the_second_batch_again(policy_dir, prompts_file):
    # prompts_per_step 8 of 11 prompts: the second step wraps into epoch 1.
    config = rl_config(policy_dir, prompts_file, prompts_per_step=8, group_size=2)
    state = rl_state(config)
    engine = state.handles.rollouts
    first = rl_source(state)
    second = rl_source(state.advance(data=first.data_after))
    assert second.data_after == DataPosition(1, 5)
    # A restored state at step 1 (same weights): the engine reads only the state it is given.
    resumed_state = dataclasses.replace(state, progress=Progress(step=1, data=first.data_after))
    assert_same_batch(engine.rollout(resumed_state), second)
    # The sampling seed depends on the step: the same prompts at another step sample differently.
    other_step = dataclasses.replace(state, progress=Progress(step=7, data=DataPosition()))
    again = engine.rollout(other_step)
    assert (
        again.micro_batches[0].rows.input_ids.tolist()
        != first.micro_batches[0].rows.input_ids.tolist()
    )


@pytest.mark.parametrize(
    ("rollout", "dp", "message"),
    [
        (
            {"prompts_per_step": 6},
            4,
            r"'rollout.prompts_per_step' = 6: must be divisible by the data-parallel size \(4\)",
        ),
        ({"temperature": 0.0}, 1, "'rollout.temperature' = 0.0: must be a finite number > 0"),
        ({"reward": ""}, 1, "'rollout.reward'"),
        ({"prompts": ""}, 1, "'rollout.prompts'"),
        ({"group_size": 0}, 1, "'rollout.group_size'"),
    ],
)
def test_bad_rollout_settings_name_the_key(tmp_path, rollout, dp, message):
    settings = dataclasses.replace(rl_config(tmp_path, tmp_path / "p.jsonl").rollout, **rollout)
    with pytest.raises(ConfigError, match=message):
        validate_rollout(settings, dp_size=dp)


def test_setup_errors_surface_when_the_engine_is_built(policy_dir, prompts_file):
    with pytest.raises(
        DataError,
        match=r"prompts.jsonl, line 1: the prompt has \d+ tokens.*raise seq_len or lower rollout",
    ):
        rl_state(dataclasses.replace(rl_config(policy_dir, prompts_file), seq_len=24))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rl_state(rl_config(policy_dir, prompts_file, reward="nope"))


def test_reward_results_and_failures_are_checked_and_name_the_prompt():
    record, where = {"prompt": "a"}, "the prompt of line 7 of rollout.prompts"
    assert score(["a", "b"], record, lambda text, sample: text == "a", "is_a", where) == [1.0, 0.0]
    # NaN and inf pass: rollout.on_bad_reward decides about them (fnt.rollout.rewards.keep_group).
    nan_if_a = lambda text, sample: float("nan") if text == "a" else 1  # noqa: E731
    nan = score(["a", "b"], record, nan_if_a, "x", where)
    assert math.isnan(nan[0]) and nan[1] == 1.0
    with pytest.raises(ValueError, match=r"reward 'bad' returned '1'"):
        score(["a"], record, lambda text, sample: "1", "bad", where)
    with pytest.raises(ValueError, match=r"'similarity' failed on the prompt of line 7.*'answer'"):
        score(["a"], record, similarity, "similarity", where)


def test_a_bad_reward_stops_the_run_or_skips_its_group(eval_model, tokenizer, prompts_file):
    prompts = load_prompts(str(prompts_file), tokenizer)

    def reward(text, sample):
        return float("nan") if sample["id"] == 1 else float(sum(map(ord, text)) % 7)

    rollout = rl_config(eval_model, prompts_file, reward="test_reward").rollout

    class Turns:
        def first(self, contexts, num_samples, max_new_tokens):
            return generate(
                eval_model,
                contexts,
                num_samples=num_samples,
                max_new_tokens=max_new_tokens,
                stop_token_ids={tokenizer.eos_token_id},
                temperature=rollout.temperature,
                generators=[torch.Generator().manual_seed(0) for _ in contexts],
            )

    def groups(chosen, on_bad_reward):
        rules = EpisodeRules(
            group_size=rollout.group_size,
            max_new_tokens=rollout.max_new_tokens,
            max_turns=1,
            max_episode_tokens=128,
            on_truncated="score",
            on_bad_reward=on_bad_reward,
            std_normalize=True,
            prompts_path="rollout.prompts",
            name="reward 'test_reward'",
            reward_name="test_reward",
        )
        environment = SingleTurnEnvironment(reward)
        episodes = run_episodes(chosen, Turns(), environment, tokenizer, rules)
        return scored_samples(episodes, environment, rules)[0]

    with pytest.raises(
        ValueError, match=r"'test_reward' returned nan on .* line 2 .*on_bad_reward"
    ):
        groups([prompts[1]], "error")
    skipped = groups([prompts[1]], "skip")
    assert len(skipped) == rollout.group_size
    assert all(s.advantage == 0.0 and math.isnan(s.reward) for s in skipped)
    kept = groups([prompts[0]], "skip")
    assert any(s.advantage != 0.0 for s in kept)


def test_rollout_metrics_of_one_process():
    def sample(reward, length, stopped):
        return single_turn((1,), Completion((2,) * length, (-1.0,) * length, stopped), reward, 0.0)

    samples = [
        sample(0.0, 4, True),
        sample(1.0, 8, False),
        sample(1.0, 2, True),
        sample(0.0, 6, True),
    ]
    metrics = rollout_metrics(samples, 2.0, one_process_runtime())
    assert metrics == {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "time/rollout": 2.0,
        "rollout/tokens_per_second": 10.0,
        "rollout/completion_len/mean": 5.0,
        "rollout/truncated_fraction": 0.25,
        "rollout/max_turns_fraction": 0.0,
        "rollout/bad_rewards": 0.0,
        "rollout/episodes": 4.0,
        "rollout/turns/mean": 1.0,
        "rollout/tool_calls/mean": 0.0,
        "rollout/tool_errors/mean": 0.0,
        "rollout/truncated_episodes": 1.0,
        "rollout/max_turns_episodes": 0.0,
        "rollout/dropped_episodes": 0.0,
        "rollout/sampled_tokens": 20.0,
        "rollout/context_tokens": 4.0,
        "rollout/env_failures": 0.0,
    }
    # An episode whose environment failed (a crashed sandbox worker) is counted.
    failed = EpisodeSample(**{**vars(samples[0]), "env_failed": True})
    metrics = rollout_metrics([failed, *samples[1:]], 2.0, one_process_runtime())
    assert metrics["rollout/env_failures"] == 1.0
    # An episode that ran out of turns is its own outcome, not a truncated one.
    out = EpisodeSample(**{**vars(samples[2]), "turns": 3, "out_of_turns": True})
    metrics = rollout_metrics([*samples[:2], out, samples[3]], 2.0, one_process_runtime())
    assert metrics["rollout/max_turns_fraction"] == 0.25
    assert metrics["rollout/max_turns_episodes"] == 1.0
    assert metrics["rollout/truncated_fraction"] == 0.25
    # A NaN reward (its group skipped) stays out of reward/*, and is counted.
    samples[1] = sample(float("nan"), 8, False)
    metrics = rollout_metrics(samples, 2.0, one_process_runtime())
    assert metrics["reward/mean"] == pytest.approx(1 / 3)
    assert metrics["rollout/bad_rewards"] == 1.0
    assert metrics["rollout/completion_len/mean"] == 5.0


def weights_checksum(model) -> str:
    """A digest of every weight's bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_each_rollout_comes_from_the_weights_after_the_previous_step(policy_dir, prompts_file):
    # Seed 0: every step has rewards to learn from, so every update changes the weights.
    state = rl_state(dataclasses.replace(rl_config(policy_dir, prompts_file), seed=0))
    made = []

    def recording_source(state):
        batch = rl_source(state)
        # The inference copy holds the weights the rollout was sampled from until the next sync.
        made.append(weights_checksum(state.handles.rollouts.model))
        return batch

    policy_after = [weights_checksum(state.handles.model)]
    for state, _ in fold(state, recording_source, rl_step, 3):
        policy_after.append(weights_checksum(state.handles.model))
    assert made == policy_after[:3]
    assert len(set(policy_after)) == 4  # every update changed the weights


def test_a_source_cannot_run_ahead_of_the_fold(policy_dir, prompts_file):
    state = rl_state(rl_config(policy_dir, prompts_file, prompts_per_step=2, group_size=2))
    batch = rl_source(state)
    assert_same_batch(rl_source(state), batch)  # asking again gives this step's batch again
    stepped, _ = rl_step(state, batch)
    with pytest.raises(StaleStateError):
        rl_source(state)  # the consumed state cannot produce another batch
    assert rl_source(stepped).data_after != batch.data_after


def test_the_engine_stops_generation_at_every_stop_token_of_the_model(
    policy_dir, prompts_file, tmp_path
):
    # generation_config.json lists a second end token besides the tokenizer's eos (as models
    # with an end-of-turn token distinct from end-of-text do); generation must stop at it too.
    model_dir = tmp_path / "model"
    shutil.copytree(policy_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    other = tokenizer.convert_tokens_to_ids("a")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [tokenizer.eos_token_id, other]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    config = rl_config(model_dir, prompts_file)
    engine = InProcessEngine(config, setup_trainer(config))
    assert {tokenizer.eos_token_id, other} <= engine.stop_token_ids
