"""Whole-episode validation (fnt.evaluation.held_out): a multi-turn environment's held-out
episodes run to their end, greedy and val.samples sampled ones (avg@k, pass@k), equal to
episodes run here by hand with fnt's episode runner; the one-turn score stays for single-turn
runs; validating changes no training row."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fnt import fold, rl_source
from fnt.config import ValConfig
from fnt.evaluation import Evaluation
from fnt.evaluation.held_out import PASS_REWARD, load_eval_data, val_seed
from fnt.model.tokenizer import stop_token_ids
from fnt.obs.metrics import to_floats
from fnt.rollout.environments.episodes import EpisodeRules, run_episodes
from fnt.rollout.environments.parsers import turn_parser
from fnt.rollout.prompts import load_prompts
from fnt.rollout.sampling import generate
from steps import rl_step

from . import multi_turn_env
from .conftest import rl_config, rl_state

K = 3


@pytest.fixture
def val_prompts(tmp_path):
    path = tmp_path / "val.jsonl"
    words = ["abc", "hello", "stop", "xyzzy", "ok", "tiny"]
    path.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in words))
    return path


def val_config(
    policy_dir, prompts_file, val_prompts, *, max_turns=3, samples=K, factory="feedback"
):
    config = rl_config(
        policy_dir,
        prompts_file,
        environment=f"tests.fnt.rollout.multi_turn_env:{factory}",
        max_turns=max_turns,
        max_new_tokens=6,
        temperature=0.7,
    )
    val = ValConfig(prompts=str(val_prompts), interval=1, eval_on_start=True, samples=samples)
    return dataclasses.replace(config, seq_len=256, batch_size=16, max_steps=1, val=val)


class HandTurns:
    """Every turn of every episode decoded alone: greedy, or sampled from a generator seeded
    by val_seed(seed, step, prompt, episode, turn)."""

    def __init__(self, model, stops, *, seed=None, temperature=1.0) -> None:
        self.model, self.stops, self.seed, self.temperature = model, stops, seed, temperature

    def _one(self, ids, num_samples, limit, key):
        sampling = {}
        if self.seed is None:
            sampling["greedy"] = True
        else:
            generator = torch.Generator().manual_seed(val_seed(self.seed, 0, *key))
            sampling.update(temperature=self.temperature, generators=[generator])
        ((*completions,),) = generate(
            self.model,
            [ids],
            num_samples=num_samples,
            max_new_tokens=limit,
            stop_token_ids=self.stops,
            **sampling,
        )
        return completions

    def first(self, prompts, num_samples, max_new_tokens):
        return [self._one(p, num_samples, max_new_tokens, (i,)) for i, p in enumerate(prompts)]

    def next(self, contexts, max_new_tokens, keys):
        return [
            self._one(c, 1, limit, key)[0] for c, limit, key in zip(contexts, max_new_tokens, keys)
        ]


def hand_episodes(policy_dir, val_prompts, config, group_size, sampler_args, factory="feedback"):
    """The held-out episodes run here, and each one's score dict (final, first)."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    environment = getattr(multi_turn_env, factory)(config.rollout)
    prompts = load_prompts(val_prompts, tokenizer, environment.start)
    rules = EpisodeRules(
        group_size=group_size,
        max_new_tokens=6,
        max_turns=config.rollout.max_turns,
        max_episode_tokens=256,
        on_truncated="score",
        on_bad_reward="error",
        std_normalize=True,
        prompts_path=str(val_prompts),
        name="feedback",
        reward_name="feedback",
        turn_parser=turn_parser(tokenizer.chat_template, "auto", "auto"),
    )
    sampler = HandTurns(model, stop_token_ids(tokenizer, policy_dir), **sampler_args)
    groups = run_episodes(prompts, sampler, environment, tokenizer, rules)
    return [[(e, environment.score(e.prompt.record, e.messages)) for e in g] for g in groups]


@pytest.mark.parametrize("factory", ["feedback", "lenient_feedback"])
def test_held_out_episodes_run_to_their_end_greedy_and_sampled(
    policy_dir, prompts_file, val_prompts, factory
):
    config = val_config(policy_dir, prompts_file, val_prompts, factory=factory)
    state = rl_state(config)
    start = Evaluation(state).row_metrics(state)

    greedy = [g[0] for g in hand_episodes(policy_dir, val_prompts, config, 1, {}, factory)]
    finals = [score["final"] for _, score in greedy]
    firsts = [score["first"] for _, score in greedy]
    assert any(e.turns > 1 for e, _ in greedy)  # the hints were answered
    assert start["val/start/reward/mean"] == pytest.approx(sum(finals) / len(finals), abs=1e-12)
    # The first answer alone (what the one-turn val scored) is another number.
    assert start["val/start/reward/first/mean"] == pytest.approx(
        sum(firsts) / len(firsts), abs=1e-12
    )
    assert start["val/start/reward/mean"] != start["val/start/reward/first/mean"]

    sampler_args = {"seed": config.seed, "temperature": 0.7}
    sampled = hand_episodes(policy_dir, val_prompts, config, K, sampler_args, factory)
    rewards = [[score["final"] for _, score in group] for group in sampled]
    assert all(len(group) == K for group in rewards)
    avg = sum(map(sum, rewards)) / (K * len(rewards))
    passed = sum(max(group) >= PASS_REWARD for group in rewards) / len(rewards)
    assert start[f"val/start/reward/avg@{K}"] == pytest.approx(avg, abs=1e-12)
    assert start[f"val/start/reward/pass@{K}"] == pytest.approx(passed, abs=1e-12)
    assert len({r for group in rewards for r in group}) > 1  # the samples differ
    if factory == "lenient_feedback":  # some prompts pass, others do not
        assert 0 < start[f"val/start/reward/pass@{K}"] < 1


def test_an_environment_run_without_a_reward_validates_with_its_environment(
    policy_dir, prompts_file, val_prompts
):
    """val.prompts in a run whose environment scores (rollout.reward left empty): the
    environment opens and scores the held-out episodes; no reward is looked up."""
    config = val_config(policy_dir, prompts_file, val_prompts)
    config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, reward=""))
    data = load_eval_data(config)
    assert data.reward_fn is None and data.environment_name.startswith("environment ")
    assert len(data.prompts) == 6 and data.whole_episodes


def test_one_turn_runs_keep_the_one_turn_score(policy_dir, prompts_file, val_prompts):
    # max_turns = 1: the feedback environment's one answer; val/reward/mean is its "final",
    # which is its first answer's.
    config = val_config(policy_dir, prompts_file, val_prompts, max_turns=1, samples=0)
    state = rl_state(config)
    start = Evaluation(state).row_metrics(state)
    assert not state.handles.val.whole_episodes
    greedy = [g[0] for g in hand_episodes(policy_dir, val_prompts, config, 1, {})]
    firsts = [score["first"] for _, score in greedy]
    assert start["val/start/reward/mean"] == pytest.approx(sum(firsts) / len(firsts), abs=1e-12)
    assert set(start) == {
        "val/start/reward/mean",
        "val/start/reward/final/mean",
        "val/start/reward/first/mean",
        "time/val",
    }


def test_sampled_validation_changes_no_training_row(policy_dir, prompts_file, val_prompts):
    config = dataclasses.replace(
        val_config(policy_dir, prompts_file, val_prompts), max_steps=2, val=ValConfig()
    )
    validated_config = val_config(policy_dir, prompts_file, val_prompts)
    validated_config = dataclasses.replace(validated_config, max_steps=2)

    def rows(config, validate):
        state = rl_state(config)
        evaluation = Evaluation(state) if validate else None
        out = []
        for state, metrics in fold(state, rl_source, rl_step, config.max_steps):
            val = evaluation.row_metrics(state) if validate else {}
            timed = ("time/", "per_second")  # clock readings
            row = {k: v for k, v in to_floats(metrics).items() if not any(t in k for t in timed)}
            out.append((row, val))
        return out

    plain = rows(config, False)
    validated = rows(validated_config, True)
    assert [m for m, _ in validated] == [m for m, _ in plain]
    keys = {f"val/reward/avg@{K}", f"val/reward/pass@{K}", "val/reward/mean"}
    assert all(keys <= set(v) for _, v in validated)
    assert all(math.isfinite(v[f"val/reward/avg@{K}"]) for _, v in validated)


def test_one_turn_episodes_score_as_the_one_turn_val(policy_dir, prompts_file, val_prompts):
    # An environment that ends every episode after its first turn: the episode path (run to the
    # end) gives exactly the one-turn path's sums, named rewards included.
    from fnt.evaluation.held_out import greedy_episode_sums, greedy_reward_sums

    config = val_config(policy_dir, prompts_file, val_prompts, factory="accepting_feedback")
    state = rl_state(config)
    data, engine, runtime = state.handles.val, state.handles.rollouts, state.handles.runtime
    assert data.whole_episodes
    engine.sync_weights_(state.handles.model)
    episodes = greedy_episode_sums(engine, data, runtime, config)
    one_turn = greedy_reward_sums(engine, data, runtime, config)
    assert episodes == one_turn and episodes[1] == 6 and episodes[2]


def test_sampled_episodes_do_not_depend_on_the_number_of_ranks(
    policy_dir, prompts_file, val_prompts
):
    # Two ranks' shares (prompts 0, 2, 4 and 1, 3, 5, each rank's sums before the all-reduce)
    # add up to one rank's sums: each prompt's samples are seeded by its index among all
    # held-out prompts, not by its place in a rank's batch.
    import types

    from fnt.evaluation.held_out import sampled_episode_sums

    config = val_config(policy_dir, prompts_file, val_prompts, factory="lenient_feedback")
    state = rl_state(config)
    data, engine = state.handles.val, state.handles.rollouts
    engine.sync_weights_(state.handles.model)

    def rank(r, dp):
        runtime = types.SimpleNamespace(
            dp_rank=r, dims=types.SimpleNamespace(dp=dp), device="cpu", distributed=False
        )
        return sampled_episode_sums(engine, data, runtime, config, step=5)

    one = rank(0, 1)
    two = [a + b for a, b in zip(rank(0, 2), rank(1, 2))]
    assert two == pytest.approx(one, abs=1e-12) and one[1] == K * 6 and one[3] == 6
