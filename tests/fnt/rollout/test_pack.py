"""pack_rollouts and first_fit: the RLMicroBatch invariants, token placement, and the errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.rollout import Completion, RolloutSample, first_fit, pack_rollouts

PAD = 257


@st.composite
def rollout_samples(draw, max_len: int):
    samples = []
    for i in range(draw(st.integers(0, 12))):
        prompt_len = draw(st.integers(1, max_len - 1))
        completion_len = draw(st.integers(1, max_len - prompt_len))
        prompt = tuple(range(1, prompt_len + 1))
        tokens = tuple(100 + i for _ in range(completion_len))
        # Logprobs strictly below 0, so a 0 in the tensor can only be a non-completion position.
        logprobs = tuple(-0.5 - 0.01 * t for t in range(completion_len))
        completion = Completion(tokens, logprobs, stopped=draw(st.booleans()))
        samples.append(
            RolloutSample(
                prompt, completion, reward=0.0, advantage=draw(st.floats(-3, 3, width=32))
            )
        )
    return samples


def documents(mb, row):
    """(start, length) of each real document in a row, from document_ids and sample_lengths."""
    starts, t = [], 0
    for length in mb.sample_lengths[row]:
        starts.append((t, length))
        t += length
    return starts


@settings(max_examples=80, deadline=None)
@given(data=st.data(), seq_len=st.integers(8, 48), mbs=st.integers(1, 3), micro=st.integers(1, 3))
def test_packed_rollouts_keep_every_sample_and_its_per_token_values(data, seq_len, mbs, micro):
    num_rows = mbs * micro
    samples = data.draw(rollout_samples(seq_len))
    settings_ = dict(
        num_rows=num_rows, seq_len=seq_len, micro_batch_size=mbs, temperature=0.7, pad_token_id=PAD
    )
    try:
        placement = first_fit([s.length for s in samples], num_rows=num_rows, seq_len=seq_len)
    except ValueError:
        with pytest.raises(ValueError, match="raise batch_size"):
            pack_rollouts(samples, **settings_)
        return
    batches = pack_rollouts(samples, **settings_)
    assert len(batches) == micro
    rows = [(mb, r) for mb in batches for r in range(mbs)]
    for (mb, r), placed in zip(rows, placement):
        mb.check()
        assert mb.rows.input_ids.shape == (mbs, seq_len)
        assert bool((mb.temperatures == 0.7).all())
        assert mb.sample_lengths[r] == tuple(samples[i].length for i in placed)
        covered = torch.zeros(seq_len, dtype=torch.bool)
        doc_ids = set()
        for i, (start, length) in zip(placed, documents(mb, r)):
            s, end = samples[i], start + length
            prompt_end = start + len(s.prompt_ids)
            assert mb.rows.input_ids[r, start:end].tolist() == [
                *s.prompt_ids,
                *s.completion.token_ids,
            ]
            assert mb.rows.position_ids[r, start:end].tolist() == list(range(length))
            assert len(set(mb.rows.document_ids[r, start:end].tolist())) == 1
            doc_ids.add(int(mb.rows.document_ids[r, start]))
            assert mb.rows.loss_mask[r, start:end].tolist() == [False] * len(s.prompt_ids) + [
                True
            ] * len(s.completion.token_ids)
            assert bool((mb.advantages[r, start:end] == s.advantage).all())
            torch.testing.assert_close(
                mb.inference_logprobs[r, prompt_end:end], torch.tensor(s.completion.logprobs)
            )
            covered[start:end] = True
        padding = ~covered
        assert len(doc_ids) == len(placed)  # every sample is its own document
        assert not doc_ids & set(mb.rows.document_ids[r][padding].tolist())
        assert bool((mb.rows.input_ids[r][padding] == PAD).all())
        assert not bool(mb.rows.loss_mask[r][padding].any())
        assert bool((mb.advantages[r][padding] == 0).all())
        # Inference logprobs are set exactly on the loss tokens.
        assert torch.equal(mb.inference_logprobs[r] != 0, mb.rows.loss_mask[r])
    assert sorted(i for row in placement for i in row) == list(range(len(samples)))


@given(lengths=st.lists(st.integers(1, 10), max_size=20), num_rows=st.integers(1, 6))
def test_first_fit_puts_each_sample_into_the_first_row_with_room(lengths, num_rows):
    try:
        rows = first_fit(lengths, num_rows=num_rows, seq_len=10)
    except ValueError:
        rows = None
    room, expected = [10] * num_rows, [[] for _ in range(num_rows)]
    for i, length in enumerate(lengths):
        fits = [r for r in range(num_rows) if room[r] >= length]
        if not fits:
            assert rows is None
            return
        expected[fits[0]].append(i)
        room[fits[0]] -= length
    assert rows == tuple(map(tuple, expected))


def sample_of(prompt_len: int, completion_len: int) -> RolloutSample:
    completion = Completion((5,) * completion_len, (-1.0,) * completion_len, stopped=False)
    return RolloutSample((1,) * prompt_len, completion, reward=0.0, advantage=1.0)


def test_a_sample_longer_than_seq_len_says_to_raise_seq_len():
    with pytest.raises(ValueError, match=r"17 tokens, more than seq_len = 16: raise seq_len"):
        pack_rollouts(
            [sample_of(9, 8)],
            num_rows=2,
            seq_len=16,
            micro_batch_size=1,
            temperature=1.0,
            pad_token_id=PAD,
        )


def test_samples_that_do_not_fit_the_rows_say_to_raise_batch_size():
    with pytest.raises(
        ValueError, match=r"3 rollout samples of 36 tokens do not fit .* 2 rows .*raise batch_size"
    ):
        pack_rollouts(
            [sample_of(6, 6)] * 3,
            num_rows=2,
            seq_len=16,
            micro_batch_size=1,
            temperature=1.0,
            pad_token_id=PAD,
        )


def test_an_empty_rank_share_is_all_padding():
    (mb,) = pack_rollouts(
        [], num_rows=2, seq_len=8, micro_batch_size=2, temperature=1.0, pad_token_id=PAD
    )
    mb.check()
    assert mb.sample_lengths == ((), ()) and not bool(mb.rows.loss_mask.any())
    assert bool((mb.rows.input_ids == PAD).all())
