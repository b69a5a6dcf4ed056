"""Under torchrun the model is built on the meta device and each rank loads only its shards; the
weights and the first logits equal `from_pretrained`'s (dense untied, dense tied, MoE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.config import ModelConfig
from fnt.model.loading import empty_hf_model
from fnt.model.sharded_load import SafetensorsDir
from fnt.model.shards import shard_bounds
from tests.e2e.helpers import run_script

from .sharded_load_check import INPUT_IDS

HERE = Path(__file__).resolve().parent


MODELS = ("tiny_model_dir", "tiny_tied_dir", "tiny_moe_dir")  # dense untied, dense tied, MoE


def sharded_load_job(fixture, out):
    models = [str(fixture(name)) for name in MODELS]
    return {"call": "tests.fnt.sharded_load_check:main", "args": [str(out), models]}


@pytest.mark.parametrize(
    "nproc",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.two_ranks(job=sharded_load_job)),
    ],
)
def test_sharded_loading_equals_from_pretrained(request, tmp_path, nproc):
    dirs = [request.getfixturevalue(name) for name in MODELS]
    assert "lm_head.weight" not in SafetensorsDir(dirs[1])  # tied: the files hold the embedding
    if nproc == 2:
        out = request.getfixturevalue("two_rank_runs")(sharded_load_job)
    else:
        out = tmp_path
        script = str(HERE / "sharded_load_check.py")
        run_script(script, str(out), *map(str, dirs), nproc=nproc, timeout=240)
    for i, model_dir in enumerate(dirs):
        got = torch.load(out / f"{i}.pt", weights_only=False)
        reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        want = reference.state_dict()
        assert got["weights"].keys() == want.keys(), model_dir
        for key, tensor in want.items():
            assert torch.equal(got["weights"][key], tensor), (model_dir, key)
        with torch.no_grad():
            logits = reference(input_ids=INPUT_IDS).logits
        torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-5)


def test_an_empty_model_holds_no_parameter_memory_but_real_buffers(tiny_model_dir):
    model = empty_hf_model(ModelConfig(name=str(tiny_model_dir)))
    assert all(p.device.type == "meta" for p in model.parameters())
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert buffer.device.type == "cpu" and torch.equal(buffer, buffers[name]), name


@pytest.mark.parametrize(("rows", "ranks"), [(10, 2), (7, 2), (3, 4), (1, 2), (8, 8)])
def test_shard_bounds_follow_fsdp2s_torch_chunk_pieces(rows, ranks):
    from torch.distributed.tensor import Replicate, Shard

    pieces = torch.arange(rows).chunk(ranks)
    for rank in range(ranks):
        want = pieces[rank].tolist() if rank < len(pieces) else []
        start, stop = shard_bounds(rows, (Shard(0),), (rank,), (ranks,))
        assert list(range(start, stop)) == want
        # HSDP: replicas hold the same rows; the shard coordinate decides.
        assert shard_bounds(rows, (Replicate(), Shard(0)), (1, rank), (2, ranks)) == (start, stop)
