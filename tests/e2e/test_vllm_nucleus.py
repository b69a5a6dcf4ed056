"""fnt's nucleus (fnt.model.lm_head.nucleus_mask) against vLLM's own top-p function, run in
vLLM's virtualenv (`make vllm-env`): the same kept set on every row, ties at the boundary
included (bfloat16-rounded logits tie often, coarser ones more). Marked vllm: `make test-vllm`
and CI run it. The server's logprobs under top-p are tests/e2e/test_vllm.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from fnt.model.lm_head import nucleus_mask
from tests.e2e.helpers import REPO

pytestmark = pytest.mark.vllm

VLLM = os.environ.get("FNT_VLLM", str(REPO / ".venv-vllm" / "bin" / "vllm"))

# What vLLM's sampler does to a batch of logits (after the temperature) with top-p and no top-k:
# -inf outside the nucleus. Its CPU build (no Triton) takes this function.
VLLM_SIDE = """
import sys
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
cases = torch.load(sys.argv[1])
logits = apply_top_k_top_p_pytorch(cases["z"].clone(), None, cases["top_ps"].clone())
torch.save(torch.isfinite(logits), sys.argv[2])
"""


def test_the_nucleus_is_vllms_own_ties_included(tmp_path):
    gen = torch.Generator().manual_seed(0)
    n, vocab = 512, 4096
    z = (3 * torch.randn(n, vocab, generator=gen)).bfloat16().float()
    z[:64] = (z[:64] * 4).round() / 4
    top_ps = 0.05 + 0.9 * torch.rand(n, generator=gen)
    cases, out = tmp_path / "cases.pt", tmp_path / "kept.pt"
    torch.save({"z": z, "top_ps": top_ps}, cases)
    python = Path(VLLM).parent / "python"
    done = subprocess.run(
        [str(python), "-c", VLLM_SIDE, str(cases), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    want = torch.load(out)

    # Rows whose boundary falls inside a tie: the smallest kept logit is also a dropped one's.
    smallest_kept = torch.where(want, z, torch.inf).min(-1, keepdim=True).values
    assert int(((z == smallest_kept) & ~want).any(-1).sum()) >= 50
    targets = torch.where(want, z, -torch.inf).argmax(-1)  # a token vLLM kept, as a sample is
    got = nucleus_mask(z, top_ps, targets)
    assert torch.equal(got, want), f"{int((got != want).any(-1).sum())} rows differ"
