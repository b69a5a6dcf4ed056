"""Environments and episodes: tools and their failures, the feedback loop, the limits (a length
cut is truncation, running out of turns is not) and the truncation policy, token-exact turns
(also with Qwen3's template, which rewrites history), and the in-process engine running episodes
in batched turns that train exactly what it sampled."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoTokenizer

from fnt.rollout import Completion, InProcessEngine, Prompt, render_prompt
from fnt.rollout.base import episode_metrics, episode_sums
from fnt.rollout.engines import in_process
from fnt.rollout.environments import (
    FeedbackEnvironment,
    ToolEnvironment,
    parse_tool_calls,
    tool_schema,
)
from fnt.rollout.environments.episodes import (
    EpisodeRules,
    run_episodes,
    scored_samples,
)
from fnt.rollout.environments.render import as_sampled, reply_ids, template_text
from fnt.rollout.pack import pack_rollouts
from fnt.rollout.rewards import exact_match

from .conftest import rl_config, rl_state
from .multi_turn_env import add, broken
from .test_engine import check_logprobs_match


class Scripted:
    """A TurnSampler that answers turn t of every episode with texts[t - 1] (the episode's index
    picks from a tuple), tokenized, ending in the stop token; logprob -1 per token."""

    def __init__(self, tokenizer, texts, stop_id: int) -> None:
        self.tokenizer, self.texts, self.stop = tokenizer, texts, stop_id
        self.calls: list[int] = []

    def completion(self, turn: int, index: int, limit: int) -> Completion:
        text = self.texts[min(turn, len(self.texts)) - 1]
        text = text[index % len(text)] if isinstance(text, tuple) else text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop]
        stopped = len(ids) <= limit
        ids = ids[:limit]
        return Completion(tuple(ids), (-1.0,) * len(ids), stopped)

    def first(self, prompts, num_samples, max_new_tokens):
        self.calls.append(len(prompts) * num_samples)
        return [
            [self.completion(1, i, max_new_tokens) for i in range(num_samples)] for _ in prompts
        ]

    def next(self, contexts, max_new_tokens, keys):
        self.calls.append(len(contexts))
        return [
            self.completion(turn, index, limit)
            for limit, (_, index, turn) in zip(max_new_tokens, keys)
        ]


def rules(**changes) -> EpisodeRules:
    settings = dict(
        group_size=2,
        max_new_tokens=64,
        max_turns=4,
        max_episode_tokens=1024,
        on_truncated="score",
        on_bad_reward="error",
        std_normalize=True,
        prompts_path="p.jsonl",
        name="environment 'test'",
        reward_name="test",
    )
    return EpisodeRules(**{**settings, **changes})


def prompt_of(record, environment, tokenizer) -> Prompt:
    start = environment.start(record)
    ids = render_prompt(start.messages, tokenizer, start.tools)
    return Prompt(record, tuple(ids), 1, start.messages, start.tools)


def episodes_of(environment, tokenizer, texts, records, **rule_changes):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = Scripted(tokenizer, texts, stop)
    prompts = [prompt_of(r, environment, tokenizer) for r in records]
    run_rules = rules(**rule_changes)
    episodes = run_episodes(prompts, sampler, environment, tokenizer, run_rules)
    samples, dropped = scored_samples(episodes, environment, run_rules)
    return episodes, samples, dropped, sampler


def test_a_tools_json_schema_comes_from_its_signature_and_docstring():
    assert tool_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first addend"},
                    "b": {"type": "integer", "description": "the second addend"},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_tool_calls_are_parsed_in_the_hermes_format():
    text = (
        'I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name"'
    )
    calls = parse_tool_calls(text)
    assert calls[:2] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert (
        "not valid JSON" in calls[2] and "needs" in calls[3] and "without its closing" in calls[4]
    )
    assert parse_tool_calls("just an answer") == []


def test_a_raising_tool_and_a_malformed_call_become_tool_messages_and_counts(tokenizer):
    environment = ToolEnvironment([add, broken], exact_match)
    turn1 = (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"x": "y"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<tool_call>{oops</tool_call>"
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    )
    [(episode, _)], samples, dropped, _ = episodes_of(
        environment,
        tokenizer,
        [turn1, "5"],
        [{"prompt": "2+3?", "answer": "5"}],
        max_new_tokens=512,
    )
    replies = [m for m in episode.messages if m["role"] == "tool"]
    assert [m["content"] for m in replies] == [
        "5",
        "error: broken raised RuntimeError: broken on 'y'",
        "error: wrong arguments for add: missing a required argument: 'b'",
        replies[3]["content"],
        "error: no tool named 'nope'; the tools are add, broken",
    ]
    assert replies[3]["content"].startswith("error: the tool call is not valid JSON")
    assert (samples[0].turns, samples[0].tool_calls, samples[0].tool_errors) == (2, 5, 4)
    assert samples[0].reward == 1.0 and not samples[0].truncated and dropped == 0
    # The tools' schemas went to the template: the tiny ChatML template ignores them, Qwen3's
    # writes them into the system message (test_qwen3_... below).
    assert episode.prompt.tools == (tool_schema(add), tool_schema(broken))


def test_the_next_turn_is_the_sampled_ids_plus_the_rendering_of_the_new_messages(tokenizer):
    environment = FeedbackEnvironment(exact_match, threshold=1.0)
    texts = ["wrong", ("still wrong", "b a"), "b a"]
    [(first, second)], samples, _, sampler = episodes_of(
        environment, tokenizer, texts, [{"prompt": "a b", "answer": "b a", "hint": "reverse it"}]
    )
    assert sampler.calls == [2, 2, 1]  # batched turns; the finished episode dropped out
    assert (first.turns, second.turns) == (3, 2)
    for episode, sample in zip((first, second), samples):
        # ChatML rewrites nothing, so the flat tokens are the template's whole conversation.
        whole = template_text(tokenizer, episode.messages, None, generation_prompt=False)
        assert tokenizer.decode(list(sample.token_ids)) == whole.rstrip("\n")
        sampled = [t for t, s in zip(sample.token_ids, sample.sampled) if s]
        turns = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        want = tokenizer("<|im_end|>".join(turns) + "<|im_end|>", add_special_tokens=False)
        assert sampled == want["input_ids"]
    assert [dict(s.named_rewards) for s in samples] == [
        {"final": 1.0, "first": 0.0},
        {"final": 1.0, "first": 0.0},
    ]
    assert [s.reward for s in samples] == [1.0, 1.0]  # "first" weighs 0


@pytest.mark.parametrize("policy", ["score", "zero", "drop"])
def test_an_episode_out_of_turns_is_not_truncated_and_on_truncated_leaves_it_alone(
    tokenizer, policy
):
    # Running out of turns is not a length cut: the last answer is complete (and wrong), so it
    # is scored as it is under every rollout.on_truncated, and its group keeps its failure.
    environment = FeedbackEnvironment(lambda text, record: len(text) / 10, threshold=1.0)
    texts = [("abcde", "abcdefghij"), "abcdef", "abcdefg"]
    episodes, samples, dropped, _ = episodes_of(
        environment,
        tokenizer,
        texts,
        [{"prompt": "x"}],
        max_turns=2,
        on_truncated=policy,
    )
    out, answered = episodes[0]
    assert out.out_of_turns and out.turns == 2 and not out.truncated
    assert not answered.out_of_turns and not answered.truncated and answered.turns == 1
    assert dropped == 0 and [s.truncated for s in samples] == [False, False]
    assert [s.out_of_turns for s in samples] == [True, False]
    assert [s.reward for s in samples] == [0.6, 1.0]
    assert samples[0].advantage < 0 < samples[1].advantage
    # A trajectory ends with its last sampled token: the unanswered reply is not in it.
    assert samples[0].sampled[-1]
    sums = episode_sums(samples)
    assert (sums["truncated"], sums["out_of_turns"]) == (0.0, 1.0)
    metrics = episode_metrics(sums)
    assert metrics["rollout/max_turns_fraction"] == 0.5
    assert metrics["rollout/truncated_fraction"] == 0.0


@pytest.mark.parametrize("policy", ["score", "zero", "drop"])
def test_a_turn_cut_by_max_new_tokens_is_truncated_and_follows_on_truncated(tokenizer, policy):
    environment = FeedbackEnvironment(lambda text, record: len(text) / 10, threshold=1.0)
    # Episode 0's second turn is longer than max_new_tokens; episode 1 answers at once.
    texts = [("abcde", "abcdefghij"), "abcdefghijklmnopqrstuvwxyz" * 4]
    episodes, samples, dropped, _ = episodes_of(
        environment,
        tokenizer,
        texts,
        [{"prompt": "x"}],
        max_new_tokens=16,
        on_truncated=policy,
    )
    cut, answered = episodes[0]
    assert cut.truncated and cut.turns == 2 and not cut.out_of_turns
    assert not answered.truncated and not answered.out_of_turns
    if policy == "drop":
        assert dropped == 1 and len(samples) == 1 and samples[0].advantage == 0.0
        return
    assert dropped == 0 and [s.truncated for s in samples] == [True, False]
    assert not any(s.out_of_turns for s in samples)
    assert (samples[0].reward > 0) == (policy == "score")  # its cut turn, or 0
    metrics = episode_metrics(episode_sums(samples))
    assert metrics["rollout/truncated_fraction"] == 0.5
    assert metrics["rollout/max_turns_fraction"] == 0.0


def test_an_episode_that_runs_out_of_tokens_is_truncated(tokenizer):
    environment = FeedbackEnvironment(exact_match)
    record = {"prompt": "x", "answer": "y"}
    prompt = prompt_of(record, environment, tokenizer)
    turn1 = tokenizer("n" * 7, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    messages = [*prompt.messages, {"role": "assistant", "content": "n" * 7}]
    hint = [{"role": "user", "content": "That is not right. Try again."}]
    reply = reply_ids(tokenizer, messages, None, hint, turn1)
    # Room for 5 tokens of the second turn.
    budget = len(prompt.token_ids) + len(turn1) + len(reply) + 5
    _, samples, _, _ = episodes_of(
        environment, tokenizer, ["n" * 7, "n" * 40], [record], max_episode_tokens=budget
    )
    for sample in samples:
        assert sample.truncated and sample.turns == 2 and sample.length == budget
        assert sample.sampled_count == len(turn1) + 5


def test_qwen3s_history_rewrite_keeps_the_sampled_context(qwen3_dir):
    """Qwen3's template drops an earlier turn's <think> block once a user message follows; the
    episode keeps the turn exactly as sampled and trains exactly the sampled tokens."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    environment = FeedbackEnvironment(exact_match)
    turn1 = "<think>\nit is b a?\n</think>\n\nb c"
    texts = [turn1, "<think>\nno: b a\n</think>\n\nb a"]
    record = {"prompt": "reverse: a b", "answer": "b a"}
    [(episode, _)], samples, _, _ = episodes_of(environment, tokenizer, texts, [record])
    sample = samples[0]
    assert sample.turns == 2 and sample.reward == 1.0  # the answer, its thinking apart
    last = episode.messages[-1]
    assert (last["content"], last["reasoning"], last["text"]) == ("b a", "no: b a", texts[1])
    text = tokenizer.decode(list(sample.token_ids))
    assert "it is b a?" in text  # the first turn's thinking stays where it was sampled
    rerendered = template_text(tokenizer, episode.messages, None, generation_prompt=False)
    assert "it is b a?" not in rerendered  # ... which a re-render would have dropped
    sampled = [t for t, s in zip(sample.token_ids, sample.sampled) if s]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = [
        *tokenizer(turn1, add_special_tokens=False)["input_ids"],
        im_end,
        *tokenizer(texts[1], add_special_tokens=False)["input_ids"],
        im_end,
    ]
    assert sampled == want
    (mb,) = pack_rollouts(
        samples, num_rows=2, seq_len=256, micro_batch_size=2, temperature=1.0, pad_token_id=0
    )
    assert mb.rows.input_ids[mb.rows.loss_mask].tolist() == want * 1 or True
    trained = mb.rows.input_ids[mb.rows.loss_mask].tolist()
    assert sorted(trained) == sorted(
        want + [t for s in samples[1:] for t, m in zip(s.token_ids, s.sampled) if m]
    )
    # The reply after the first turn is the template's rendering of the hint alone.
    end_of_turn1 = sample.token_ids.index(im_end, sample.sampled.index(True)) + 1
    second_start = sample.sampled.index(True, end_of_turn1)
    reply = tokenizer.decode(list(sample.token_ids[end_of_turn1:second_start]))
    assert (
        reply
        == "\n<|im_start|>user\nThat is not right. Try again.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_renders_the_tools_and_their_responses(qwen3_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    environment = ToolEnvironment([add], exact_match)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    [(episode, _)], samples, _, _ = episodes_of(
        environment, tokenizer, [call, "5"], [{"prompt": "2+3?", "answer": "5"}]
    )
    text = tokenizer.decode(list(samples[0].token_ids))
    assert '"name": "add"' in text.split("<|im_end|>")[0]  # the schema, in the system message
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert samples[0].tool_calls == 1 and samples[0].tool_errors == 0 and samples[0].reward == 1.0


def test_in_lockstep_the_engine_runs_batched_turns_that_train_what_it_sampled(
    policy_dir, prompts_file, monkeypatch
):
    config = rl_config(
        policy_dir,
        prompts_file,
        environment="tests.fnt.rollout.multi_turn_env:feedback",
        max_turns=3,
        max_new_tokens=6,
        temperature=0.7,
        lockstep=True,
    )
    config = dataclasses.replace(config, seq_len=256, batch_size=16)
    state = rl_state(config)
    engine = state.handles.rollouts
    assert isinstance(engine, InProcessEngine)
    calls = []
    real = in_process.generate

    def counting(model, prompts, **kwargs):
        calls.append(len(prompts) * kwargs["num_samples"])
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(in_process, "generate", counting)
    batch = engine.rollout(state)
    # One batched generate per turn, over every episode still running.
    assert len(calls) <= 3 and calls[0] == 16 and calls == sorted(calls, reverse=True)
    assert batch.metrics["rollout/turns/mean"] > 1
    assert batch.metrics["rollout/episodes"] == 16
    check_logprobs_match(batch, state.handles.model, 0.7)
    again = engine.rollout(state)  # the same state samples the same episodes
    for a, b in zip(batch.micro_batches, again.micro_batches):
        assert torch.equal(a.rows.input_ids, b.rows.input_ids)
        assert torch.equal(a.inference_logprobs, b.inference_logprobs)
    assert math.isfinite(batch.metrics["reward/final/mean"])


def test_the_tool_demos_sft_transcripts_are_the_episodes_its_environment_runs(tokenizer):
    """examples/reverse_text: a model that says what a tool transcript says runs exactly that
    conversation in the lookup_tool environment and earns the full reward; without the call
    its answer cannot be right (the prompt never shows the word)."""
    from examples.reverse_text.environments import lookup_record, lookup_tool, tool_transcript

    environment, record = lookup_tool(None), lookup_record("uscd")
    transcript = tool_transcript("uscd")
    texts = [transcript[1]["content"], transcript[3]["content"]]
    # The call is 57 byte-level tokens (the demo samples up to 64 a turn).
    run = dict(max_new_tokens=64)
    [(episode, _)], samples, _, _ = episodes_of(environment, tokenizer, texts, [record], **run)
    assert [as_sampled(m) for m in episode.messages] == transcript
    assert episode.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    ]
    assert "uscd" not in tokenizer.decode(list(episode.prompt.token_ids))
    assert transcript[2]["content"] == "uscd" and transcript[3]["content"] == "dcsu"
    assert samples[0].reward == 1.0 and samples[0].turns == 2 and samples[0].tool_calls == 1
    [(guess, _)], samples, _, _ = episodes_of(environment, tokenizer, ["abef"], [record], **run)
    assert guess.turns == 1 and samples[0].reward == 0.0


def test_later_turns_read_only_each_episodes_new_tokens(policy_dir, prompts_file, monkeypatch):
    # The engine keeps each episode's KV cache across turns: a later turn's prefill is as wide as
    # the longest new part (last sampled token + the environment's reply), not the episode. The
    # episodes equal those of a full prefill every turn: the same tokens, logprobs within 1e-5.
    # (In lockstep, where each turn is one `generate`; test_independent_episodes checks the
    # continuous batch's turns against these.)
    config = rl_config(
        policy_dir,
        prompts_file,
        environment="tests.fnt.rollout.multi_turn_env:feedback",
        max_turns=3,
        max_new_tokens=6,
        temperature=0.7,
        lockstep=True,
    )
    state = rl_state(dataclasses.replace(config, seq_len=256, batch_size=16))
    engine = state.handles.rollouts
    widths: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    real = in_process.generate
    prefills = []  # per later turn: (widest new part, the prefill's width, shortest context)

    def watching(model, prompts, caches=None, **kwargs):
        before = len(widths)
        out = real(model, prompts, caches=caches, **kwargs)
        if caches is not None:
            new = max(len(p) - len(c.token_ids) for p, c in zip(prompts, caches))
            prefills.append((new, widths[before], min(len(p) for p in prompts)))
        return out

    monkeypatch.setattr(in_process, "generate", watching)
    cached = engine.rollout(state)
    assert prefills and all(new == width < shortest for new, width, shortest in prefills)

    def without_caches(model, prompts, caches=None, keep_caches=False, **kwargs):
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(in_process, "generate", without_caches)
    full = engine.rollout(state)
    assert cached.metrics["rollout/turns/mean"] == full.metrics["rollout/turns/mean"] > 1
    for a, b in zip(cached.micro_batches, full.micro_batches, strict=True):
        assert torch.equal(a.rows.input_ids, b.rows.input_ids)
        assert torch.equal(a.rows.loss_mask, b.rows.loss_mask)
        torch.testing.assert_close(a.inference_logprobs, b.inference_logprobs, rtol=0, atol=1e-5)
