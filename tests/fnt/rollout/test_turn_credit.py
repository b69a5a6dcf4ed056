"""Per-turn credit (rollout.credit = "turn"): returns-to-go and their group advantages computed by
hand, each turn's tokens trained on its turn's advantage, "episode" credit exactly as before,
the checks of the keys and of what score_turns returns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fnt.config import ConfigError, RLLossConfig, RolloutConfig, validate_rollout
from fnt.config.modes import check_rl
from fnt.errors import UserCodeError
from fnt.model.lm_head import TokenLogprobs
from fnt.rollout.advantages import EPS, discounted_returns, group_advantages, turn_advantages
from fnt.rollout.environments import FeedbackEnvironment, Reply, Start
from fnt.rollout.environments.episodes import require_turn_scores, run_episodes, scored_samples
from fnt.rollout.pack import pack_rollouts
from fnt.rollout.saved_samples import sample_record
from steps.rl import loss_inputs, policy_loss

from .conftest import rl_config
from .test_environments import Scripted, prompt_of, rules

# Three episodes of one prompt, told apart by the scripted sampler's episode index: A answers
# a1, a2, a3 (3 turns), B answers b and stops (1 turn), C answers c1, c2 (2 turns).
TEXTS = [("a1", "b", "c1"), ("a2", "b", "c2"), ("a3", "b", "c3")]
LAST = {"a3", "b", "c2"}  # the answers after which the environment ends the episode
TURN_REWARDS = {"a1": 1.0, "a2": 0.0, "a3": 0.0, "b": 0.0, "c1": 0.5, "c2": 0.0}
SCORE = {"a3": 2.0, "b": 1.0, "c2": 0.0}


def answers(messages) -> list[str]:
    return [m["content"].strip() for m in messages if m["role"] == "assistant"]


class Scripted3:
    """Ends each episode after the answers in LAST; rewards each turn by TURN_REWARDS and the
    episode by its last answer's SCORE."""

    def __init__(self, turn_rewards=TURN_REWARDS, last=LAST, scores=SCORE) -> None:
        self.turn_rewards, self.last, self.scores = turn_rewards, last, scores
        self.turn_calls = 0

    def start(self, record):
        return Start(({"role": "user", "content": record["prompt"]},))

    def respond(self, record, messages):
        if answers(messages)[-1] in self.last:
            return None
        return Reply(({"role": "user", "content": "go on"},))

    def score(self, record, messages):
        return self.scores[answers(messages)[-1]]

    def score_turns(self, record, messages):
        self.turn_calls += 1
        return [self.turn_rewards[a] for a in answers(messages)]


def run(environment, tokenizer, texts=TEXTS, **rule_changes):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_rules = rules(group_size=3, **rule_changes)
    prompts = [prompt_of({"prompt": "x"}, environment, tokenizer)]
    episodes = run_episodes(
        prompts, Scripted(tokenizer, texts, stop), environment, tokenizer, run_rules
    )
    samples, dropped = scored_samples(episodes, environment, run_rules)
    assert dropped == 0
    return episodes[0], samples


def test_discounted_returns_by_hand():
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert discounted_returns([3.0], 0.5) == [3.0]
    assert discounted_returns([1.0, 2.0, 3.0], 1.0) == [6.0, 5.0, 3.0]


# By hand, discount 0.5, the score added to the last turn's reward:
#   A: rewards (1, 0, 0 + 2): G = (1 + 0.5 * 1, 0 + 0.5 * 2, 2) = (1.5, 1, 2)
#   B: rewards (0 + 1):       G = (1,)
#   C: rewards (0.5, 0 + 0):  G = (0.5, 0)
# Turn 1: G_1 = (1.5, 1, 0.5), mean 1, population std sqrt(1/6); turn 2: A and C reached it,
# G_2 = (1, 0), mean 0.5, std 0.5; turn 3: A alone, advantage 0.
CENTERED = [[0.5, 0.5, 0.0], [0.0], [-0.5, -0.5]]


@pytest.mark.parametrize("std_normalize", [False, True])
def test_a_three_turn_groups_advantages_by_hand(tokenizer, std_normalize):
    environment = Scripted3()
    episodes, samples = run(
        environment, tokenizer, credit="turn", turn_discount=0.5, std_normalize=std_normalize
    )
    assert [e.turns for e in episodes] == [3, 1, 2]
    scales = [math.sqrt(1 / 6) + EPS, 0.5 + EPS, 1.0] if std_normalize else [1.0] * 3
    expected = [
        [torch.tensor(a / scale).float().item() for a, scale in zip(ep, scales)] for ep in CENTERED
    ]
    for episode, sample, want in zip(episodes, samples, expected):
        spans = episode.turn_spans
        assert len(spans) == episode.turns
        for (start, end), advantage in zip(spans, want):
            assert sample.token_advantages[start:end] == (advantage,) * (end - start)
        # Context (the prompt, the replies) carries 0; every sampled token is in some turn.
        in_turns = {t for start, end in spans for t in range(start, end)}
        assert in_turns == {t for t, s in enumerate(sample.sampled) if s}
        assert all(
            sample.token_advantages[t] == 0.0 for t in range(sample.length) if t not in in_turns
        )
        assert sample.advantage == want[0]
    assert [s.turn_rewards for s in samples] == [(1.0, 0.0, 0.0), (0.0,), (0.5, 0.0)]
    assert [s.reward for s in samples] == [2.0, 1.0, 0.0]  # the score, as under episode credit

    # Packed: the loss reads each sampled token's own turn's advantage.
    (mb,) = pack_rollouts(
        samples, num_rows=3, seq_len=128, micro_batch_size=3, temperature=1.0, pad_token_id=0
    )
    trained = sorted(
        (
            adv
            for sample, ep in zip(samples, expected)
            for adv, n in zip(ep, span_lengths(sample))
            for _ in range(n)
        ),
    )
    assert sorted(mb.advantages[mb.rows.loss_mask].tolist()) == pytest.approx(trained, abs=0)

    record = sample_record(samples[0], tokenizer)
    assert record["turn_advantages"] == expected[0]
    assert record["turn_rewards"] == [1.0, 0.0, 0.0]


def span_lengths(sample) -> list[int]:
    lengths, run_length = [], 0
    for flag in (*sample.sampled, False):
        if flag:
            run_length += 1
        elif run_length:
            lengths.append(run_length)
            run_length = 0
    return lengths


def test_each_turn_index_is_normalized_over_the_episodes_that_reached_it():
    # Turn 1 of every episode is its group's (as episode credit); a turn reached by one episode
    # alone gets 0, and so does a turn whose returns are equal.
    assert turn_advantages([[1.0, 1.0, 1.0], [0.0]], std_normalize=False) == [
        [0.5, 0.0, 0.0],
        [-0.5],
    ]
    assert turn_advantages([[1.0, 0.5], [1.0, 0.5], [1.0]], std_normalize=True) == [
        [0.0, 0.0],
        [0.0, 0.0],
        [0.0],
    ]
    assert turn_advantages([[2.0, 3.0], [0.0, 1.0]], std_normalize=False) == [
        [1.0, 1.0],
        [-1.0, -1.0],
    ]
    with pytest.raises(ValueError, match="finite"):
        turn_advantages([[math.inf], [0.0]], std_normalize=False)


def test_zero_turn_rewards_at_discount_1_give_exactly_the_episode_credit(tokenizer):
    """Turn credit generalizes episode credit: with every turn reward 0, no discount and
    episodes of equal length, the same samples train on bit for bit the same advantages, and so
    give the same loss."""
    texts = [("a1", "b1", "c1"), ("a2", "b2", "c2")]
    environment = dict(
        turn_rewards=dict.fromkeys(["a1", "b1", "c1", "a2", "b2", "c2"], 0.0),
        last={"a2", "b2", "c2"},
        scores={"a2": 2.0, "b2": 1.0, "c2": 0.0},
    )
    _, by_episode = run(Scripted3(**environment), tokenizer, texts)
    _, by_turn = run(Scripted3(**environment), tokenizer, texts, credit="turn", turn_discount=1.0)
    assert all(s.turns == 2 for s in by_turn)
    assert [s.advantage for s in by_turn] == [s.advantage for s in by_episode]
    packed = [
        pack_rollouts(
            s, num_rows=3, seq_len=128, micro_batch_size=3, temperature=1.0, pad_token_id=0
        )[0]
        for s in (by_episode, by_turn)
    ]
    mask = packed[0].rows.loss_mask
    assert torch.equal(packed[0].rows.input_ids, packed[1].rows.input_ids)
    assert torch.equal(packed[0].advantages[mask], packed[1].advantages[mask])
    logp = -torch.rand(int(mask.sum()), generator=torch.Generator().manual_seed(0))
    losses = [
        policy_loss(loss_inputs(TokenLogprobs(logp, None), mb), RLLossConfig())[0] for mb in packed
    ]
    assert torch.equal(losses[0], losses[1])


def test_episode_credit_is_the_group_advantage_on_every_token_and_never_asks_for_turns(
    tokenizer,
):
    environment = Scripted3()
    _, samples = run(environment, tokenizer)  # credit "episode", the default
    assert environment.turn_calls == 0
    want = group_advantages([[2.0, 1.0, 0.0]], std_normalize=True)[0].tolist()
    assert [s.advantage for s in samples] == want
    assert all(s.token_advantages is None and s.turn_rewards == () for s in samples)
    for sample in samples:
        (mb,) = pack_rollouts(
            [sample], num_rows=1, seq_len=128, micro_batch_size=1, temperature=1.0, pad_token_id=0
        )
        assert mb.sample_lengths == ((sample.length,),)
        want = torch.full((sample.length,), sample.advantage)
        assert torch.equal(mb.advantages[0, : sample.length], want)


def test_an_environment_without_score_turns_is_refused_for_turn_credit():
    environment = FeedbackEnvironment(lambda text, record: 1.0)
    require_turn_scores(environment, rules(credit="turn"))  # the built-in one scores turns

    class Plain:
        def start(self, record): ...
        def respond(self, record, messages): ...
        def score(self, record, messages): ...

    require_turn_scores(Plain(), rules())  # episode credit needs none
    with pytest.raises(ConfigError, match=r"'rollout.credit' = 'turn': environment 'test'"):
        require_turn_scores(Plain(), rules(credit="turn"))


class WrongTurns(Scripted3):
    def __init__(self, value) -> None:
        super().__init__()
        self.value = value

    def score_turns(self, record, messages):
        if self.value == "raise":
            raise RuntimeError("no turn scores today")
        if self.value == "nan":
            return [math.nan] * len(answers(messages))
        return self.value


@pytest.mark.parametrize("value", [[1.0], "ab", {"a": 1.0}, [True, False, True], None])
def test_score_turns_must_return_one_float_per_turn(tokenizer, value):
    with pytest.raises(
        UserCodeError,
        match=r"its score_turns\) returned .*expected a list of one float per model turn \(3\)",
    ):
        run(WrongTurns(value), tokenizer, credit="turn")


def test_a_raising_score_turns_stops_the_run_or_skips_its_group(tokenizer):
    with pytest.raises(UserCodeError, match="no turn scores today"):
        run(WrongTurns("raise"), tokenizer, credit="turn")
    _, samples = run(WrongTurns("raise"), tokenizer, credit="turn", on_bad_reward="skip")
    assert [s.advantage for s in samples] == [0.0, 0.0, 0.0]
    _, samples = run(WrongTurns("nan"), tokenizer, credit="turn", on_bad_reward="skip")
    assert [s.advantage for s in samples] == [0.0, 0.0, 0.0]


def test_the_feedback_environment_charges_each_turned_down_answer_its_shortfall():
    environment = FeedbackEnvironment(lambda text, record: len(text) / 10, threshold=0.5)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab"},
        {"role": "user", "content": "hint"},
        {"role": "assistant", "content": "abcd"},
        {"role": "user", "content": "hint"},
        {"role": "assistant", "content": "abcdef"},
    ]
    assert environment.score_turns({}, messages) == pytest.approx([-0.3, -0.1, 0.0])


@pytest.mark.parametrize("discount", [0.0, -0.5, 1.5, math.nan, math.inf])
def test_turn_discount_outside_0_1_is_refused(discount):
    rollout = RolloutConfig(prompts="p.jsonl", environment="m:f", turn_discount=discount)
    with pytest.raises(ConfigError, match=r"'rollout.turn_discount' = .*must be in \(0, 1\]"):
        validate_rollout(rollout, dp_size=1)


def test_turn_credit_needs_an_environment_and_an_engine_that_runs_episodes(policy_dir, tmp_path):
    rollout = RolloutConfig(prompts="p.jsonl", reward="similarity", credit="turn")
    with pytest.raises(
        ConfigError, match=r"'rollout.credit' = 'turn': \"turn\" needs rollout.environment"
    ):
        validate_rollout(rollout, dp_size=1)
    validate_rollout(dataclasses.replace(rollout, environment="m:f", turn_discount=0.9), dp_size=1)
    config = rl_config(policy_dir, tmp_path / "p.jsonl", credit="turn", environment="m:f")
    config = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, engine="external")
    )
    with pytest.raises(ConfigError, match=r"'rollout.credit' = 'turn': the external engine"):
        check_rl(config, 1)
