"""Two data-parallel ranks (FSDP2, gloo) generate exactly the global batch one process generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import run_script

from .two_ranks import two_batches

REPO = Path(__file__).resolve().parents[3]


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


def test_two_ranks_sample_what_one_process_samples(policy_dir, prompts_file, tmp_path):
    script = str(Path(__file__).with_name("two_ranks.py"))
    run_script(script, str(policy_dir), str(prompts_file), str(tmp_path), nproc=2, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _, single = two_batches(str(policy_dir), str(prompts_file))
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
        for got, want in zip(merged, expected):
            torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-6)
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
