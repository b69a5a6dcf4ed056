"""Two data-parallel ranks (FSDP2, gloo) generate exactly the global batch one process generates."""

from __future__ import annotations

import pytest
import torch

from fnt.store.samples import read_step_samples

from .two_ranks import two_batches


def documents(batch):
    """Every packed sample as (token ids, loss mask, advantage, inference logprobs), sorted."""
    docs = []
    for mb in batch.micro_batches:
        for r, lengths in enumerate(mb.sample_lengths):
            t = 0
            for length in lengths:
                end = t + length
                docs.append(
                    (
                        tuple(mb.rows.input_ids[r, t:end].tolist()),
                        tuple(mb.rows.loss_mask[r, t:end].tolist()),
                        float(mb.advantages[r, t]),
                        mb.inference_logprobs[r, t:end],
                    )
                )
                t = end
    return sorted(docs, key=lambda d: d[:3])


def two_batches_job(fixture, out):
    inputs = [str(fixture("policy_dir")), str(fixture("prompts_file"))]
    return {"call": "tests.fnt.rollout.two_ranks:save_two_batches", "args": [*inputs, str(out)]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=two_batches_job)
def test_two_ranks_sample_what_one_process_samples(
    policy_dir, prompts_file, two_rank_runs, tmp_path
):
    out = two_rank_runs(two_batches_job)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _, single = two_batches(str(policy_dir), str(prompts_file), str(tmp_path))
    # Rank 0 saved both ranks' samples, in prompt order: the one-process run's samples.
    for step in (1, 2):
        saved = read_step_samples(out / "run", step)
        assert [r["rank"] for r in saved] == [0] * 8 + [1] * 8
        alone = read_step_samples(tmp_path, step)
        assert [(r["prompt"], r["completion"]) for r in saved] == [
            (r["prompt"], r["completion"]) for r in alone
        ], step
    for step in range(2):
        one, shares = single[step], [rank[step] for rank in ranks]
        assert [b.data_after for b in shares] == [one.data_after] * 2
        assert [b.num_samples for b in shares] == [8, 8] and one.num_samples == 16
        assert all(
            len(b.micro_batches) == 2 for b in shares
        )  # batch_size 8 over 2 ranks: 4 rows each
        merged = sorted(documents(shares[0]) + documents(shares[1]), key=lambda d: d[:3])
        expected = documents(one)
        assert [d[:3] for d in merged] == [d[:3] for d in expected]
        # logp = logit - logsumexp, terms near log(V) = 5.6 whose float32 ulp is 4.8e-7: rows
        # decoded in another batch (other padding, other reduction order) round each term
        # differently, by a few ulps (measured: up to 1.1e-6).
        for got, want in zip(merged, expected):
            torch.testing.assert_close(got[3], want[3], rtol=0, atol=4e-6)
        for key in (
            "reward/mean",
            "reward/std",
            "rollout/completion_len/mean",
            "rollout/truncated_fraction",
        ):
            assert (
                shares[0].metrics[key] == shares[1].metrics[key] == pytest.approx(one.metrics[key])
            ), key
        assert shares[0].metrics["time/rollout"] == shares[1].metrics["time/rollout"]
