"""Packed documents == the same documents run alone, with the block-causal mask the trainer uses."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.batch import PackedRows, block_causal_mask
from fnt.config.schema import DataConfig, DataSourceConfig
from fnt.data import load_source_data
from fnt.state import Progress
from fnt.update import packed_logits


@pytest.fixture(scope="module")
def packed_rows(tmp_path_factory, tokenizer) -> PackedRows:
    """Two rows of 96 tokens, each with several chat documents and padding, from the pipeline."""
    path = tmp_path_factory.mktemp("isolation") / "chats.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": "tell me " + "ab" * i, "completion": "sure " * (i % 3)}) + "\n"
            for i in range(8)
        )
    )
    data = DataConfig(
        kind="sources",
        sources=(DataSourceConfig(path=str(path), weight=1.0, name=""),),
        overlong="truncate",
        shuffle=True,
    )
    batch = load_source_data(
        data, tokenizer, seed=0, seq_len=96, batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1
    ).batch(Progress())
    rows = batch.micro_batches[0]
    assert (rows.document_ids.max(dim=1).values >= 2).all(), (
        "each row should hold 2+ documents and padding"
    )
    return rows


@pytest.fixture(
    scope="module",
    params=[("tiny_model_dir", "sdpa"), ("tiny_moe_dir", "sdpa"), ("tiny_model_dir", "eager")],
    ids=["dense-sdpa", "moe-sdpa", "dense-eager"],
)
def model(request):
    model_dir, attn = request.param
    return AutoModelForCausalLM.from_pretrained(
        request.getfixturevalue(model_dir), attn_implementation=attn, dtype=torch.float32
    ).eval()


def logits_alone(model, rows: PackedRows) -> torch.Tensor:
    """Each document (padding included) run as its own sequence, put back in place."""
    out = torch.empty(*rows.input_ids.shape, model.config.vocab_size)
    for r in range(rows.input_ids.shape[0]):
        for d in rows.document_ids[r].unique().tolist():
            where = rows.document_ids[r] == d
            out[r, where] = model(input_ids=rows.input_ids[r, where][None]).logits[0]
    return out


@torch.no_grad()
def test_packed_logits_equal_each_document_run_alone(model, packed_rows):
    rows = packed_rows
    packed = packed_logits(model, rows)  # exactly how the trainer calls the model
    torch.testing.assert_close(packed, logits_alone(model, rows), atol=1e-5, rtol=0)


@torch.no_grad()
def test_without_the_document_mask_packed_logits_differ(model, packed_rows):
    """The equality above is not vacuous: a causal mask over a whole row leaks across documents."""
    rows = packed_rows
    one_document = torch.zeros_like(rows.document_ids)
    leaky = model(
        input_ids=rows.input_ids,
        position_ids=rows.position_ids,
        attention_mask=block_causal_mask(one_document),
    ).logits
    # Default call with restarted position ids and no mask: transformers 5.24 builds a cache when
    # use_cache is on, and with a cache it does not infer documents from position ids either.
    unmasked = model(input_ids=rows.input_ids, position_ids=rows.position_ids).logits
    alone = logits_alone(model, rows)
    later_documents = rows.document_ids > 0
    for logits in (leaky, unmasked):
        assert (logits - alone)[later_documents].abs().max() > 1e-3
