"""pack_rollouts, first_fit and the fitted layout: the RLMicroBatch invariants, token placement,
the errors, and the same loss and gradients as rows of seq_len."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnt.rollout import Completion, RolloutSample, first_fit, pack_rollouts
from fnt.rollout.pack import ROW_MULTIPLE, empty_plan, fixed_layout, plan_micro_batches, single_turn

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
            single_turn(prompt, completion, reward=0.0, advantage=draw(st.floats(-3, 3, width=32)))
        )
    return samples


def documents(mb, row):
    """(start, length) of each real document in a row, from document_ids and sample_lengths."""
    starts, t = [], 0
    for length in mb.sample_lengths[row]:
        starts.append((t, length))
        t += length
    return starts


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    seq_len=st.integers(8, 48),
    mbs=st.integers(1, 3),
    micro=st.integers(1, 3),
    fitted=st.booleans(),
)
def test_packed_rollouts_keep_every_sample_and_its_per_token_values(
    data, seq_len, mbs, micro, fitted
):
    num_rows = mbs * micro
    samples = data.draw(rollout_samples(seq_len))
    lengths = [s.length for s in samples]
    settings_ = dict(
        num_rows=num_rows, seq_len=seq_len, micro_batch_size=mbs, temperature=0.7, pad_token_id=PAD
    )
    layout = plan_micro_batches if fitted else partial(fixed_layout, num_rows=num_rows)
    plans = layout(lengths, seq_len=seq_len, micro_batch_size=mbs)
    batches = pack_rollouts(samples, **settings_, fitted=fitted)
    # The fixed layout has num_rows rows, or whole micro-batches more when the samples need them.
    needed = len(first_fit(lengths, num_rows=num_rows, seq_len=seq_len))
    assert len(batches) == len(plans) == (len(plans) if fitted else -(-needed // mbs))
    placement = [row for plan in plans for row in plan.rows]
    rows = [(mb, r) for mb in batches for r in range(mb.rows.input_ids.shape[0])]
    assert len(rows) == len(placement)
    for (mb, r), placed in zip(rows, placement):
        mb.check()
        row_len = mb.rows.input_ids.shape[1]
        # At most the token budget of micro_batch_size rows of seq_len.
        assert row_len <= seq_len and mb.rows.input_ids.numel() <= mbs * seq_len
        assert bool((mb.temperatures == 0.7).all())
        assert mb.sample_lengths[r] == tuple(samples[i].length for i in placed)
        covered = torch.zeros(row_len, dtype=torch.bool)
        doc_ids = set()
        for i, (start, length) in zip(placed, documents(mb, r)):
            s, end = samples[i], start + length
            assert mb.rows.input_ids[r, start:end].tolist() == list(s.token_ids)
            assert mb.rows.position_ids[r, start:end].tolist() == list(range(length))
            assert len(set(mb.rows.document_ids[r, start:end].tolist())) == 1
            doc_ids.add(int(mb.rows.document_ids[r, start]))
            assert mb.rows.loss_mask[r, start:end].tolist() == list(s.sampled)
            assert bool((mb.advantages[r, start:end] == s.advantage).all())
            torch.testing.assert_close(
                mb.inference_logprobs[r, start:end], torch.tensor(s.logprobs)
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


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), max_size=40),
    seq_len=st.integers(64, 100),
    mbs=st.integers(1, 4),
)
def test_fitted_rows_are_as_long_as_their_longest_sample_rounded_up(lengths, seq_len, mbs):
    plans = plan_micro_batches(lengths, seq_len=seq_len, micro_batch_size=mbs)
    placed = [i for plan in plans for row in plan.rows for i in row]
    assert sorted(placed) == list(range(len(lengths)))
    # Longest first: each micro-batch takes the longest samples the earlier ones left.
    sizes = [[lengths[i] for row in plan.rows for i in row] for plan in plans]
    for earlier, later in zip(sizes, sizes[1:]):
        assert max(later) <= min(earlier)
    for plan in plans:
        longest = max((lengths[i] for row in plan.rows for i in row), default=0)
        if lengths:
            assert plan.row_len == min(seq_len, -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE)
        assert len(plan.rows) * plan.row_len <= mbs * seq_len
        assert all(sum(lengths[i] for i in row) <= plan.row_len for row in plan.rows)
    if not lengths:
        assert plans == (empty_plan(),)


@given(lengths=st.lists(st.integers(1, 10), max_size=20), num_rows=st.integers(1, 6))
def test_first_fit_puts_each_sample_into_the_first_row_with_room(lengths, num_rows):
    rows = first_fit(lengths, num_rows=num_rows, seq_len=10)
    room, expected = [10] * num_rows, [[] for _ in range(num_rows)]
    for i, length in enumerate(lengths):
        fits = [r for r in range(len(room)) if room[r] >= length]
        if not fits:  # a new row after the others
            room.append(10)
            expected.append([])
            fits = [len(room) - 1]
        expected[fits[0]].append(i)
        room[fits[0]] -= length
    assert rows == tuple(map(tuple, expected))
    assert len(rows) >= num_rows


def sample_of(prompt_len: int, completion_len: int) -> RolloutSample:
    completion = Completion((5,) * completion_len, (-1.0,) * completion_len, stopped=False)
    return single_turn((1,) * prompt_len, completion, reward=0.0, advantage=1.0)


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


@pytest.mark.parametrize("fitted", [True, False])
def test_samples_that_outgrow_the_rows_get_more_micro_batches(fitted):
    # 3 samples of 12 tokens need 3 rows of 16; the rank has 2 rows of micro-batches of 1 row.
    batches = pack_rollouts(
        [sample_of(6, 6)] * 3,
        num_rows=2,
        seq_len=16,
        micro_batch_size=1,
        temperature=1.0,
        pad_token_id=PAD,
        fitted=fitted,
    )
    assert len(batches) == 3
    for mb in batches:
        mb.check()
        assert mb.sample_lengths == ((12,),)
        assert mb.rows.input_ids.numel() <= 16  # the token budget of one micro-batch


@pytest.mark.parametrize("fitted", [True, False])
def test_an_empty_rank_share_is_all_padding(fitted):
    (mb,) = pack_rollouts(
        [],
        num_rows=2,
        seq_len=16,
        micro_batch_size=2,
        temperature=1.0,
        pad_token_id=PAD,
        fitted=fitted,
    )
    mb.check()
    assert mb.sample_lengths == (((),) if fitted else ((), ()))
    assert mb.rows.input_ids.shape == ((1, ROW_MULTIPLE) if fitted else (2, 16))
    assert not bool(mb.rows.loss_mask.any()) and bool((mb.rows.input_ids == PAD).all())


def test_a_share_gets_all_padding_micro_batches_up_to_the_count_every_rank_runs():
    samples = [sample_of(6, 4), sample_of(3, 2)]
    batches = pack_rollouts(
        samples,
        num_rows=4,
        seq_len=32,
        micro_batch_size=2,
        temperature=1.0,
        pad_token_id=PAD,
        num_micro_batches=3,
    )
    assert len(batches) == 3
    # The fitted rows: 10 and 5 tokens fit one row of 16 (10 rounded up).
    assert batches[0].rows.input_ids.shape == (1, 16) and batches[0].sample_lengths == ((10, 5),)
    for mb in batches[1:]:
        mb.check()
        assert not bool(mb.rows.loss_mask.any())


def rl_grads(model, batches, loss_config):
    from fnt.batch import DataPosition, RLBatch
    from steps.rl import rl_gradients_

    from .conftest import one_process_runtime

    model.zero_grad(set_to_none=True)
    batch = RLBatch(batches, num_samples=0, data_after=DataPosition())
    totals = rl_gradients_(model, batch, one_process_runtime(), loss_config, 64)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return totals, grads


def test_fitted_rows_give_the_loss_and_gradients_of_rows_of_seq_len(eval_model):
    from fnt.config import RLLossConfig

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(14):  # 7 groups of 2, of different prompt and completion lengths
        prompt_len, completion_len = 3 + (i * 7) % 19, 1 + (i * 5) % 11
        prompt = tuple(torch.randint(0, 256, (prompt_len,), generator=gen).tolist())
        tokens = tuple(torch.randint(0, 256, (completion_len,), generator=gen).tolist())
        # Inference logprobs off the policy's, so the ratios (and the masking) matter.
        logprobs = tuple((-5.5 + 0.5 * torch.rand(completion_len, generator=gen)).tolist())
        advantage = float(torch.randn((), generator=gen))
        samples.append(single_turn(prompt, Completion(tokens, logprobs, False), 0.0, advantage))
    settings_ = dict(num_rows=8, seq_len=128, micro_batch_size=2, temperature=0.7, pad_token_id=PAD)
    fixed = pack_rollouts(samples, **settings_, fitted=False)
    fitted = pack_rollouts(samples, **settings_)
    assert {mb.rows.input_ids.shape[1] for mb in fitted} != {128}
    model = eval_model.train()
    loss_config = RLLossConfig(kind="ratio", eps_low=0.2, eps_high=0.28, kl_tau=0.1)
    want, want_grads = rl_grads(model, fixed, loss_config)
    got, got_grads = rl_grads(model, fitted, loss_config)
    assert got.loss_tokens == want.loss_tokens > 0
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-6)
    for key in want.sums:
        torch.testing.assert_close(got.sums[key], want.sums[key], rtol=1e-5, atol=1e-5)
    assert float(want.sums["masked_high"] + want.sums["masked_low"]) > 0
    for name, grad in want_grads.items():
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
