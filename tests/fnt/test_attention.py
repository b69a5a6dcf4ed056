"""Attention inputs by kernel: a block-causal T x T mask for sdpa/eager, document boundaries and
nothing T x T for the varlen flash kernels; and, on a GPU with flash-attn, packed == alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.data.synthetic import synthetic_rows
from fnt.model.attention import VARLEN_KERNELS, document_boundaries, packed_inputs


def rows_and_documents():
    rows, _ = synthetic_rows(seed=2, step=1, num_rows=3, seq_len=48)
    return rows


def with_kernel(model, kernel: str):
    # Only the name the loss code reads: building the kernel itself needs CUDA and flash-attn.
    model.config._attn_implementation = kernel
    return model


@pytest.mark.parametrize("kernel", VARLEN_KERNELS)
def test_varlen_kernels_get_boundaries_and_nothing_t_by_t(tiny_model_dir, kernel):
    model = with_kernel(AutoModelForCausalLM.from_pretrained(tiny_model_dir), kernel)
    rows = rows_and_documents()
    B, T = rows.input_ids.shape
    inputs = packed_inputs(model, rows)
    assert "attention_mask" not in inputs
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            assert value.numel() < T * T, (name, tuple(value.shape))
    # Boundaries: every document of every row, in the flattened order, restart positions 0.
    flat_positions = rows.position_ids.flatten()
    starts = inputs["cu_seq_lens_q"][:-1].long()
    assert torch.equal(starts, (flat_positions == 0).nonzero().flatten())
    assert int(inputs["cu_seq_lens_q"][-1]) == B * T
    lengths = inputs["cu_seq_lens_q"].diff()
    assert inputs["max_length_q"] == int(lengths.max()) and int(lengths.min()) > 0


def test_sdpa_and_eager_get_the_block_causal_mask(tiny_model_dir):
    rows = rows_and_documents()
    T = rows.input_ids.shape[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for kernel in ("sdpa", "eager"):
        mask = packed_inputs(with_kernel(model, kernel), rows)["attention_mask"]
        assert mask.shape[-2:] == (T, T)
        visible = mask if mask.dtype == torch.bool else mask == 0
        same_doc = rows.document_ids[:, :, None] == rows.document_ids[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        assert torch.equal(visible[:, 0], same_doc & causal)


def test_boundaries_split_rows_even_when_document_ids_repeat_across_rows():
    document_ids = torch.tensor([[0, 0, 1], [0, 1, 1]])
    cumulative, longest = document_boundaries(document_ids)
    assert cumulative.tolist() == [0, 2, 3, 4, 6] and longest == 2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", VARLEN_KERNELS)
def test_packed_equals_alone_with_a_varlen_kernel(tiny_model_dir, kernel):
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    pytest.importorskip("flash_attn" if kernel == "flash_attention_2" else "flash_attn_interface")
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=kernel
    ).cuda()
    rows = rows_and_documents()
    device_rows = type(rows)(*(getattr(rows, f).cuda() for f in rows.__dataclass_fields__))
    with torch.no_grad():
        packed = model(**packed_inputs(model, device_rows)).logits.float()
        for b in range(rows.input_ids.shape[0]):
            for doc in rows.document_ids[b].unique():
                where = (rows.document_ids[b] == doc).nonzero().flatten().cuda()
                alone = model(input_ids=device_rows.input_ids[b, where][None]).logits.float()
                torch.testing.assert_close(packed[b, where], alone[0], rtol=0.02, atol=0.02)
