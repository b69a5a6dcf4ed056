"""generate: reproducible sampling, recorded logprobs, eos handling, and KV cache == no cache."""

from __future__ import annotations

import pytest
import torch

from fnt.rollout import generate, render_prompt, sampling_seed

EOS = 256  # <|im_end|> of the tiny byte-level tokenizer


def prompt(tokenizer, text: str) -> list[int]:
    return render_prompt([{"role": "user", "content": text}], tokenizer)


def sample(model, ids, seed_triple, **kw):
    generator = torch.Generator().manual_seed(sampling_seed(*seed_triple))
    kw = {"num_samples": 6, "max_new_tokens": 12, "eos_token_id": EOS, "temperature": 1.0, **kw}
    return generate(model, ids, generator=generator, **kw)


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
    completions = generate(
        eval_model, ids, num_samples=2, max_new_tokens=12, eos_token_id=EOS, greedy=True
    )
    reference = greedy_without_cache(eval_model, ids, 12)
    assert [list(c.token_ids) for c in completions] == [reference, reference]


def test_greedy_decoding_stops_early_on_some_prompts(eval_model, tokenizer):
    lengths = {
        len(
            generate(
                eval_model,
                prompt(tokenizer, t),
                num_samples=1,
                max_new_tokens=12,
                eos_token_id=EOS,
                greedy=True,
            )[0].token_ids
        )
        for t in ["ab", "olleh", "falcon", "xyz", "cat", "dove"]
    }
    assert min(lengths) < 12


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"num_samples": 0}, "num_samples"),
        ({"max_new_tokens": 0}, "max_new"),
    ],
)
def test_bad_arguments_are_rejected(eval_model, kw, message):
    with pytest.raises(ValueError, match=message):
        generate(
            eval_model, [1, 2], **{"num_samples": 1, "max_new_tokens": 4, "eos_token_id": EOS, **kw}
        )


def test_sampling_seeds_differ_by_seed_step_and_slot():
    seeds = {
        sampling_seed(s, step, slot) for s in range(3) for step in range(3) for slot in range(3)
    }
    assert len(seeds) == 27 and all(0 <= x < 2**63 for x in seeds)
