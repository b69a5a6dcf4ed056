"""Context that changes: an environment that rewrites the history (Reply.history, a summary in
place of old turns) ends the episode's sample, and the episode goes on in a new one that shares
its advantage; the in-process engine samples it without the stale KV cache."""

from __future__ import annotations

import dataclasses

import torch

from fnt.rollout import InProcessEngine
from fnt.rollout.base import episode_sums
from fnt.rollout.environments import Reply, Start
from fnt.rollout.environments.episodes import run_episodes, scored_samples
from fnt.rollout.prompts import render_prompt
from fnt.rollout.saved_samples import sample_record

from .conftest import rl_config, rl_state
from .test_environments import Scripted, prompt_of, rules


def answers(messages) -> list[str]:
    return [m["content"].strip() for m in messages if m["role"] == "assistant"]


class Compacting:
    """After the first turn, an answer starting with "a" gets its conversation replaced by a
    summary (or, with `long_summary`, one too long for the episode's budget); any other gets a
    plain reply, unless `always`. The second turn ends the episode; the score is the last
    answer's length."""

    def __init__(self, long_summary: bool = False, always: bool = False) -> None:
        self.long_summary, self.always = long_summary, always
        self.seen: list[list[str]] = []

    def start(self, record):
        return Start(({"role": "user", "content": record["prompt"]},))

    def respond(self, record, messages):
        said = answers(messages)
        if len(said) >= 2 or messages[0]["content"].startswith("Summary:"):
            return None
        go_on = ({"role": "user", "content": "go on"},)
        if not (self.always or said[-1].startswith("a")):
            return Reply(go_on)
        summary = "x " * 2000 if self.long_summary else f"earlier you said {said[-1]}"
        return Reply(go_on, history=({"role": "user", "content": f"Summary: {summary}"},))

    def score(self, record, messages):
        self.seen.append([m["content"] for m in messages])
        return float(len(answers(messages)[-1]))

    def score_turns(self, record, messages):
        return [0.5, 0.0]


def compacting(rollout):
    return Compacting(always=True)


def run(tokenizer, environment, **rule_changes):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = [("a1", "b1"), ("a22", "b2")]
    run_rules = rules(**rule_changes)
    prompts = [prompt_of({"prompt": "x"}, environment, tokenizer)]
    sampler = Scripted(tokenizer, texts, stop)
    episodes = run_episodes(prompts, sampler, environment, tokenizer, run_rules)
    samples, _ = scored_samples(episodes, environment, run_rules)
    return episodes[0], samples, stop


def test_a_rewritten_history_starts_a_new_sample_that_shares_the_episodes_advantage(tokenizer):
    environment = Compacting()
    (a, b), samples, stop = run(tokenizer, environment)
    assert len(a.closed) == 1 and not b.closed
    first, rest, other = samples
    assert [s.continued for s in samples] == [True, False, False]
    assert [s.turns for s in samples] == [1, 1, 2]
    # The first sample ends with the first turn's tokens, after the original prompt.
    prompt = list(a.prompt.token_ids)
    turn1 = tokenizer("a1", add_special_tokens=False)["input_ids"] + [stop]
    assert list(first.token_ids) == prompt + turn1 and first.sampled[-1]
    # The second starts with the rendering of the summary and the reply, then the second turn.
    history = [
        {"role": "user", "content": "Summary: earlier you said a1"},
        {"role": "user", "content": "go on"},
    ]
    context = render_prompt(history, tokenizer)
    turn2 = tokenizer("a22", add_special_tokens=False)["input_ids"] + [stop]
    assert list(rest.token_ids) == context + turn2
    assert rest.sampled == (False,) * len(context) + (True,) * len(turn2)
    # One reward and one advantage per episode, on both of its samples.
    assert first.reward == rest.reward == 3.0 and other.reward == 2.0
    assert first.advantage == rest.advantage > 0 > other.advantage
    assert first.named_rewards == () and not first.truncated
    assert sample_record(first, tokenizer)["continued"] is True
    assert "continued" not in sample_record(rest, tokenizer)
    # The score saw the rewritten conversation.
    assert environment.seen[0] == [m["content"] for m in history] + ["a22"]
    # An episode counts once, its turns all.
    sums = episode_sums(samples)
    assert sums["episodes"] == 2 and sums["turns"] == 4 and sums["reward_sum"] == 5.0


def test_under_turn_credit_each_sample_trains_on_its_own_turns_advantages(tokenizer):
    (a, b), samples, _ = run(tokenizer, Compacting(), credit="turn", turn_discount=0.5)
    first, rest, other = samples
    # Returns: A (0.5, 0 + 3) -> (2.0, 3.0); B (0.5, 0 + 2) -> (1.5, 2.0); per turn index,
    # A is above B by as much as B is below: +-0.25 and +-0.5, normalized to +-1 (std + eps).
    plus = torch.tensor(0.25 / (0.25 + 1e-4)).float().item()
    sampled = [t for t, s in enumerate(first.sampled) if s]
    assert {first.token_advantages[t] for t in sampled} == {plus}
    sampled = [t for t, s in enumerate(rest.sampled) if s]
    assert {rest.token_advantages[t] for t in sampled} == {torch.tensor(0.5 / 0.5001).item()}
    assert first.turn_rewards == (0.5,) and rest.turn_rewards == (0.0,)
    assert other.turn_rewards == (0.5, 0.0)


def test_a_history_that_leaves_no_room_truncates_the_episode(tokenizer):
    (a, _), samples, _ = run(tokenizer, Compacting(long_summary=True), max_episode_tokens=512)
    assert a.truncated and not a.closed and a.turns == 1
    assert len(samples) == 2 and not any(s.continued for s in samples)


def test_the_engine_samples_episodes_whose_history_is_rewritten(policy_dir, prompts_file):
    config = rl_config(
        policy_dir,
        prompts_file,
        environment="tests.fnt.rollout.test_history_rewrite:compacting",
        max_turns=2,
        max_new_tokens=6,
        temperature=0.7,
    )
    config = dataclasses.replace(config, seq_len=256, batch_size=16)
    state = rl_state(config)
    engine = state.handles.rollouts
    assert isinstance(engine, InProcessEngine)
    batch = engine.rollout(state)
    assert batch.metrics["rollout/episodes"] == 16
    # Every episode not cut in its first turn went on in a second sample, sampled after a
    # context that its KV cache from the first turn does not begin.
    assert batch.num_samples > 16
    again = engine.rollout(state)  # the same state samples the same episodes
    for x, y in zip(batch.micro_batches, again.micro_batches):
        assert torch.equal(x.rows.input_ids, y.rows.input_ids)
        assert torch.equal(x.inference_logprobs, y.inference_logprobs)
