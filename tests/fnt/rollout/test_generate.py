"""generate: reproducible sampling, recorded logprobs, stop tokens, KV cache == no cache, and a
batch of prompts == each prompt alone."""

from __future__ import annotations

import pytest
import torch

from fnt.rollout import generate, render_prompt, sampling_seed

EOS = 256  # <|im_end|> of the tiny byte-level tokenizer


def prompt(tokenizer, text: str) -> list[int]:
    return render_prompt([{"role": "user", "content": text}], tokenizer)


def sample(model, ids, seed_triple, **kw):
    generator = torch.Generator().manual_seed(sampling_seed(*seed_triple))
    kw = {"num_samples": 6, "max_new_tokens": 12, "stop_token_ids": {EOS}, "temperature": 1.0, **kw}
    (completions,) = generate(model, [ids], generators=[generator], **kw)
    return completions


def test_the_same_seed_step_and_slot_give_the_same_completions(eval_model, tokenizer):
    ids = prompt(tokenizer, "olleh")
    first = sample(eval_model, ids, (0, 5, 1))
    assert sample(eval_model, ids, (0, 5, 1)) == first
    assert sample(eval_model, ids, (0, 6, 1)) != first
    assert sample(eval_model, ids, (0, 5, 2)) != first
    assert sample(eval_model, ids, (1, 5, 1)) != first


def test_completions_stop_at_eos_or_max_new_tokens(eval_model, tokenizer):
    completions = []
    for text in ("ab", "olleh", "xyz"):
        completions += sample(eval_model, prompt(tokenizer, text), (0, 1, 0))
    # The fixture model makes both endings common; the properties below need both.
    assert {c.stopped for c in completions} == {True, False}
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) <= 12
        assert (c.token_ids[-1] == EOS) == c.stopped
        assert EOS not in c.token_ids[:-1]
        assert c.stopped or len(c.token_ids) == 12
        assert all(lp <= 0 for lp in c.logprobs)


def test_recorded_logprobs_equal_a_fresh_forward_of_the_policy(policy_dir, eval_model, tokenizer):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_dir)  # train mode, like the live policy
    ids = prompt(tokenizer, "kiwi")
    lengths = set()
    for temperature in (0.7, 1.0):
        for c in sample(eval_model, ids, (2, 3, 0), temperature=temperature):
            lengths.add(len(c.token_ids))
            full = torch.tensor([ids + list(c.token_ids)])
            with torch.no_grad():
                logits = policy(input_ids=full).logits[0].float()
            logp = torch.log_softmax(logits[len(ids) - 1 : -1] / temperature, dim=-1)
            expected = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)
    assert len(lengths) > 1  # rows left the decoding batch at different steps


def greedy_without_cache(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(
                model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1].argmax()
            )
            out.append(token)
            if token == EOS:
                break
    return out[len(ids) :]


@pytest.mark.parametrize("text", ["ab", "olleh", "falcon", "xyz"])
def test_greedy_decoding_with_the_kv_cache_equals_decoding_without_it(eval_model, tokenizer, text):
    ids = prompt(tokenizer, text)
    (completions,) = generate(
        eval_model, [ids], num_samples=2, max_new_tokens=12, stop_token_ids={EOS}, greedy=True
    )
    reference = greedy_without_cache(eval_model, ids, 12)
    assert [list(c.token_ids) for c in completions] == [reference, reference]


def test_greedy_decoding_of_a_batch_stops_early_on_some_prompts(eval_model, tokenizer):
    texts = ["ab", "olleh", "falcon", "xyz", "cat", "dove"]
    groups = generate(
        eval_model,
        [prompt(tokenizer, t) for t in texts],
        num_samples=1,
        max_new_tokens=12,
        stop_token_ids={EOS},
        greedy=True,
    )
    assert min(len(c.token_ids) for (c,) in groups) < 12
    # Each prompt of the batch decodes as it does alone (and, above, as without the cache).
    for text, (c,) in zip(texts, groups):
        assert list(c.token_ids) == greedy_without_cache(eval_model, prompt(tokenizer, text), 12)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"num_samples": 0}, "num_samples"),
        ({"max_new_tokens": 0}, "max_new"),
        ({"stop_token_ids": set()}, "stop_token_ids"),
        ({"prompts": []}, "no prompts"),
        ({"prompts": [[1], []]}, "empty prompt"),
        ({"generators": [None]}, "1 generators for 2 prompts"),
    ],
)
def test_bad_arguments_are_rejected(eval_model, kw, message):
    args = {
        "prompts": [[1, 2], [3]],
        "num_samples": 1,
        "max_new_tokens": 4,
        "stop_token_ids": {EOS},
    }
    with pytest.raises(ValueError, match=message):
        generate(eval_model, **{**args, **kw})


def test_sampling_seeds_differ_by_seed_step_and_slot():
    seeds = {
        sampling_seed(s, step, slot) for s in range(3) for step in range(3) for slot in range(3)
    }
    assert len(seeds) == 27 and all(0 <= x < 2**63 for x in seeds)


def test_a_batch_of_prompts_samples_what_each_prompt_samples_alone(eval_model, tokenizer):
    # Prompts of different lengths: the batch left-pads all but the longest.
    texts = ["ab", "olleh", "falcon", "xyz", "kiwi"]
    ids = [prompt(tokenizer, t) for t in texts]
    assert len({len(i) for i in ids}) > 1
    seeds = [(4, 2, slot) for slot in range(len(texts))]
    generators = [torch.Generator().manual_seed(sampling_seed(*s)) for s in seeds]
    batched = generate(
        eval_model,
        ids,
        num_samples=6,
        max_new_tokens=12,
        stop_token_ids={EOS},
        temperature=1.0,
        generators=generators,
    )
    lengths = set()
    for prompt_ids, seed, group in zip(ids, seeds, batched):
        alone = sample(eval_model, prompt_ids, seed)
        assert [c.token_ids for c in group] == [c.token_ids for c in alone]
        assert [c.stopped for c in group] == [c.stopped for c in alone]
        for b, a in zip(group, alone):
            lengths.add(len(b.token_ids))
            # A padded batched forward may differ from one of the prompt alone in the last bits.
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5
            )
    assert len(lengths) > 1  # rows of different prompts left the batch at different steps


def test_every_stop_token_ends_a_completion(eval_model, tokenizer):
    ids = prompt(tokenizer, "olleh")
    (free,) = generate(
        eval_model, [ids], num_samples=1, max_new_tokens=12, stop_token_ids={EOS}, greedy=True
    )
    (completion,) = free
    # Stop also at the greedy answer's third token (not eos): the answer ends right there.
    third = completion.token_ids[2]
    assert third not in completion.token_ids[:2] and third != EOS
    ((stopped,),) = generate(
        eval_model,
        [ids],
        num_samples=1,
        max_new_tokens=12,
        stop_token_ids={EOS, third},
        greedy=True,
    )
    assert stopped.token_ids == completion.token_ids[:3] and stopped.stopped


def fed_widths(model):
    """A list that gets the width of every forward's input_ids, and the hook's handle."""
    widths: list[int] = []

    def record(module, args, kwargs):
        widths.append(kwargs["input_ids"].shape[1])

    return widths, model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_kept_cache_reads_only_the_new_tokens_and_samples_as_a_full_prefill(
    eval_model, tokenizer, greedy
):
    # Three turns of episodes of different lengths: each later turn's context is the previous
    # one, the sampled tokens and a reply. With the completions' caches only the tokens after
    # them are read (the prefill is as wide as the longest new part), and the samples are the
    # ones a prefill of the whole context draws from the same generators: the same tokens, the
    # logprobs within 1e-5 (a forward over cached keys differs from a full one in the last bits).
    reply = prompt(tokenizer, "again")
    contexts = [prompt(tokenizer, t) for t in ("ab", "olleh", "falcon")]
    kw = {"max_new_tokens": 8, "stop_token_ids": {EOS}, "temperature": 0.8, "greedy": greedy}

    def generators(turn):
        return [torch.Generator().manual_seed(sampling_seed(9, turn, i)) for i in range(6)]

    first = generate(
        eval_model, contexts, num_samples=2, generators=generators(1)[:3], keep_caches=True, **kw
    )
    completions = [c for group in first for c in group]
    contexts = [p for p in contexts for _ in range(2)]
    for turn in (2, 3):
        contexts = [p + list(c.token_ids) + reply for p, c in zip(contexts, completions)]
        caches = [c.cache for c in completions]
        assert all(c.token_ids == tuple(p[: len(c.token_ids)]) for c, p in zip(caches, contexts))
        widths, hook = fed_widths(eval_model)
        try:
            cached = generate(
                eval_model,
                contexts,
                num_samples=1,
                generators=generators(turn),
                caches=caches,
                keep_caches=True,
                **kw,
            )
        finally:
            hook.remove()
        full = generate(eval_model, contexts, num_samples=1, generators=generators(turn), **kw)
        new_parts = [len(p) - len(c.token_ids) for p, c in zip(contexts, caches)]
        assert widths[0] == max(new_parts) == 1 + len(reply)  # the last sampled token + reply
        assert widths[0] < min(len(p) for p in contexts)
        assert [c.token_ids for (c,) in cached] == [c.token_ids for (c,) in full]
        for (a,), (b,) in zip(cached, full):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
            )
        completions = [c for (c,) in cached]
    assert len({len(p) for p in contexts}) > 1  # the rows' caches had different lengths


def test_a_cache_must_be_of_a_proper_prefix_of_its_prompt(eval_model, tokenizer):
    ids = prompt(tokenizer, "kiwi")
    kw = {"num_samples": 1, "max_new_tokens": 3, "stop_token_ids": {EOS}, "greedy": True}
    ((done,),) = generate(eval_model, [ids], keep_caches=True, **kw)
    assert done.cache is not None and done.cache.token_ids == tuple(ids) + done.token_ids[:-1]
    with pytest.raises(ValueError, match="cache of prompt 0 is not of a proper prefix"):
        other = (done.cache.token_ids[-1] + 1) % EOS  # another last token, then one more
        generate(eval_model, [[*done.cache.token_ids[:-1], other, 7]], caches=[done.cache], **kw)
    with pytest.raises(ValueError, match="cache of prompt 0 is not of a proper prefix"):
        generate(eval_model, [list(done.cache.token_ids)], caches=[done.cache], **kw)
