"""Attention by kernel (fnt.model.attention): the kernel table and "auto"; what each kernel is
given (document boundaries and nothing T x T for the varlen kernels, FlexAttention's tiles from
the host layout, a block-causal mask or, for rows of one document, none for sdpa); packed
documents == each document alone, logits and gradients, for every kernel that runs on a CPU,
for torch's varlen kernel through fnt's attention function with a CPU stand-in of the same
signature, and FlexAttention's forward (it has no backward on a CPU); on a GPU, the real
kernels."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing

import pytest
import torch
from transformers import AutoModelForCausalLM

import fnt.model.attention as attention
from fnt.batch import PackedRows, row_layout, to_device
from fnt.config import Config, ConfigError, ModelConfig
from fnt.data.synthetic import synthetic_rows
from fnt.model.attention import (
    KERNELS,
    decoding_attention,
    document_boundaries,
    document_tiles,
    hf_attention_name,
    kernel_problem,
    packed_inputs,
    resolve_kernel,
    varlen_options,
)
from fnt.model.loading import attention_for
from fnt.start import with_device_choices

BOUNDARY_KERNELS = [name for name, k in KERNELS.items() if k.documents == "boundaries"]


def packed_rows() -> PackedRows:
    rows, docs = synthetic_rows(seed=2, step=1, num_rows=3, seq_len=48)
    assert min(docs) >= 2  # several documents in every row
    return rows


def one_document_rows() -> PackedRows:
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).expand(2, 40).clone()
    return PackedRows(ids, positions, torch.zeros_like(ids), positions > 0)


def load(model_dir, kernel: str):
    name = hf_attention_name(kernel)
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=name)


def offering(monkeypatch, available: set[str]) -> None:
    """Make exactly the kernels `available` installed (on the devices of their table row)."""
    table = {
        name: dataclasses.replace(k, needs=lambda name=name: None if name in available else "no")
        for name, k in KERNELS.items()
    }
    monkeypatch.setattr(attention, "KERNELS", table)


def test_auto_is_sdpa_on_a_cpu_and_the_first_available_kernel_on_cuda(monkeypatch):
    assert resolve_kernel("auto", "cpu", "bfloat16") == "sdpa"
    for name in KERNELS:
        assert resolve_kernel(name, "cpu", "float32") == name  # an explicit choice is kept
    assert "cuda" in kernel_problem("varlen", "cpu")
    everything = set(KERNELS)
    offering(monkeypatch, everything)
    assert resolve_kernel("auto", "cpu", "bfloat16") == "sdpa"
    assert resolve_kernel("auto", "cuda", "bfloat16") == "flash_attention_3"
    assert resolve_kernel("auto", "cuda", "float32") == "flex"  # flash kernels are 16-bit
    assert "float32" in kernel_problem("varlen", "cuda", "float32")
    offering(monkeypatch, everything - {"flash_attention_3"})
    assert resolve_kernel("auto", "cuda", "bfloat16") == "varlen"
    offering(monkeypatch, everything - {"flash_attention_3", "varlen"})
    assert resolve_kernel("auto", "cuda", "bfloat16") == "flash_attention_2"
    offering(monkeypatch, {"flex", "sdpa", "eager"})
    assert resolve_kernel("auto", "cuda", "bfloat16") == "flex"
    offering(monkeypatch, {"sdpa", "eager"})
    assert resolve_kernel("auto", "cuda", "bfloat16") == "sdpa"
    assert resolve_kernel("auto", "mps", "bfloat16") == "sdpa"  # a device the table does not know


def test_the_config_takes_every_kernel_of_the_table_and_auto():
    hint = typing.get_type_hints(ModelConfig)["attn_implementation"]
    assert set(typing.get_args(hint)) == {"auto", *KERNELS}


def test_torch_says_where_its_varlen_kernel_is():
    has_varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    assert (kernel_problem("varlen", "cuda") is None) == has_varlen


def test_the_model_config_gets_the_resolved_kernel(tiny_model_dir):
    assert attention_for(ModelConfig(name=str(tiny_model_dir)), "cpu") == "fnt_sdpa"
    assert attention_for(ModelConfig(attn_implementation="eager"), "cpu") == "eager"
    model = load(tiny_model_dir, "sdpa")
    assert attention.attention_kernel(model) == "sdpa"


def test_torch_varlen_arguments_follow_its_signature():
    # torch 2.11: causal is window_size = (-1, 0), no enable_gqa (key/value heads repeated).
    older = frozenset({"query", "key", "value", "scale", "window_size", "return_aux"})
    assert varlen_options(older, groups=2) == ({"window_size": (-1, 0)}, True)
    assert varlen_options(older, groups=1) == ({"window_size": (-1, 0)}, False)
    # torch 2.13: enable_gqa.
    newer = older | {"enable_gqa"}
    assert varlen_options(newer, groups=2) == ({"window_size": (-1, 0), "enable_gqa": True}, False)
    # An is_causal flag, where a release has one.
    assert varlen_options(frozenset({"is_causal"}), groups=1) == ({"is_causal": True}, False)
    with pytest.raises(RuntimeError, match="neither is_causal nor window_size"):
        varlen_options(frozenset({"query"}), groups=1)


def test_the_varlen_function_compiles_into_one_graph_with_this_torchs_kernel():
    """A compiled layer on CUDA (model.compile "auto") runs fnt's varlen function: with this
    torch's own varlen_attn (torch 2.11's takes window_size and no enable_gqa) it traces into
    one graph, forward and backward, at dynamic lengths. Traced only: the kernel is CUDA's, so
    the compiled graphs are recorded, not run (the gpu-marked compile test runs them)."""
    problem = kernel_problem("varlen", "cuda")
    if problem is not None:  # an older torch: the kernel is refused, never compiled
        assert "torch >= 2.10" in problem
        return
    from torch._dynamo.backends.common import aot_autograd

    attention.register_kernels_()
    traced: dict[str, list[str]] = {}

    class Recorded(Exception):
        pass

    def recorder(kind):
        def compile_(graph, example_inputs):
            calls = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            traced[kind] = [c for c in calls if "varlen" in c]

            def run(*args):
                raise Recorded(kind)

            return run

        return compile_

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    module = torch.nn.Module()  # training: no dropout is asked for
    q = torch.randn(2, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cumulative = torch.tensor([0, 5, 16, 20, 32], dtype=torch.int32)

    def loss(q, k, v, cumulative, longest):
        out, _ = attention.fnt_varlen_attention(
            module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cumulative,
            cu_seq_lens_k=cumulative, max_length_q=longest, max_length_k=longest,
        )  # fmt: skip
        return out.float().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=backend, fullgraph=True, dynamic=True)
    with pytest.raises(Recorded, match="forward"):
        compiled(q, k, v, cumulative, 12)
    torch._dynamo.reset()
    assert traced == {
        "forward": ["torch_attn._varlen_attn.default"],
        "backward": ["torch_attn._varlen_attn_backward.default"],
    }


@pytest.mark.parametrize("kernel", BOUNDARY_KERNELS)
def test_varlen_kernels_get_boundaries_and_nothing_t_by_t(tiny_model_dir, kernel):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config._attn_implementation = KERNELS[kernel].hf_name  # only the name is read here
    rows = packed_rows()
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


@pytest.mark.parametrize("seed", range(40))
def test_flex_tiles_are_those_the_block_causal_mask_touches(seed):
    """A tile of the row's attention is listed iff a query of it sees a key of it, and listed
    as seen whole iff every query sees every key (below the diagonal): what the dense mask
    says, for rows of random documents, lengths around and across the 128-token tiles."""
    rng = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 8, (1,), generator=rng))
    lengths = tuple(int(n) for n in torch.randint(1, 300, (count,), generator=rng))
    ids = torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))[None]
    dense = attention.block_causal_mask(ids)[0, 0]
    tiles = -(-dense.shape[0] // attention.BLOCK)
    partial, whole = document_tiles(lengths)
    for i in range(tiles):
        assert not set(partial[i]) & set(whole[i])
        for j in range(tiles):
            tile = dense[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert (j in partial[i] or j in whole[i]) == bool(tile.any()), (i, j)
            assert (j in whole[i]) == (j < i and bool(tile.all())), (i, j)


def test_flex_gets_a_block_mask_of_the_documents_and_nothing_t_by_t(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config._attn_implementation = KERNELS["flex"].hf_name
    rows = packed_rows()
    B, T = rows.input_ids.shape
    mask = packed_inputs(model, rows)["attention_mask"]
    assert type(mask).__name__ == "BlockMask" and mask.seq_lengths == (T, T)
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.numel() < T * T for t in tensors)
    dense = mask.to_dense()  # [B, 1, tiles, tiles]: the tiles listed
    expected = attention.block_causal_mask(rows.document_ids)
    assert torch.equal(dense.bool()[:, 0, 0, 0], expected[:, 0, :128, :128].flatten(1).any(1))
    with pytest.raises(ValueError, match="decoding_attention"):
        load(tiny_model_dir, "flex")(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


@pytest.mark.numerics
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", ["packed", "one_document"])
def test_flex_packed_equals_each_document_alone_forward_on_a_cpu(tiny_model_dir, layout):
    """fnt's FlexAttention function with its block mask, torch's eager FlexAttention under it
    (no backward on a CPU: the gpu-marked tests check gradients): logits within 1e-5, rows
    longer than one 128-token tile."""
    rows, _ = synthetic_rows(seed=3, step=1, num_rows=2, seq_len=300)
    if layout == "one_document":
        rows = dataclasses.replace(rows, document_ids=torch.zeros_like(rows.document_ids))
        rows = dataclasses.replace(rows, position_ids=torch.arange(300).expand(2, 300).clone())
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    weights = torch.zeros(*rows.input_ids.shape, reference.config.vocab_size)
    alone, _ = per_document_logits_and_grads(reference, rows, weights)
    model = load(tiny_model_dir, "flex")
    with torch.no_grad():
        packed = model(**packed_inputs(model, rows)).logits
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_sdpa_gets_the_block_causal_mask_or_none_for_rows_of_one_document(tiny_model_dir):
    rows = packed_rows()
    T = rows.input_ids.shape[1]
    for kernel in ("sdpa", "eager"):
        mask = packed_inputs(load(tiny_model_dir, kernel), rows)["attention_mask"]
        assert mask.shape[-2:] == (T, T)
        visible = mask if mask.dtype == torch.bool else mask == 0
        same_doc = rows.document_ids[:, :, None] == rows.document_ids[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        assert torch.equal(visible[:, 0], same_doc & causal)
    single = one_document_rows()
    assert packed_inputs(load(tiny_model_dir, "sdpa"), single)["attention_mask"] is None
    assert packed_inputs(load(tiny_model_dir, "eager"), single)["attention_mask"] is not None


def test_boundaries_split_rows_even_when_document_ids_repeat_across_rows():
    document_ids = torch.tensor([[0, 0, 1], [0, 1, 1]])
    rows = PackedRows(
        torch.zeros_like(document_ids), torch.zeros_like(document_ids), document_ids,
        torch.zeros_like(document_ids, dtype=torch.bool),
    )  # fmt: skip
    cumulative, longest = document_boundaries(row_layout(rows), torch.device("cpu"))
    assert cumulative.tolist() == [0, 2, 3, 4, 6] and longest == 2
    assert cumulative.dtype == torch.int32


def test_moved_rows_keep_their_host_layout_and_a_replaced_row_reads_its_own():
    rows = packed_rows()
    moved = to_device(rows, torch.device("cpu"))
    assert moved is not rows and moved.__dict__["_layout"] is not None  # set by the move
    assert row_layout(moved).document_lengths == row_layout(rows).document_lengths
    assert torch.equal(row_layout(moved).loss_index, row_layout(rows).loss_index)
    assert torch.equal(
        row_layout(moved).loss_index, torch.nn.functional.pad(rows.loss_mask[:, 1:], (0, 1))
        .flatten().nonzero().flatten()
    )  # fmt: skip
    cleared = dataclasses.replace(moved, loss_mask=torch.zeros_like(moved.loss_mask))
    assert row_layout(cleared).num_loss_tokens == 0 < row_layout(moved).num_loss_tokens


def reference_varlen(calls: list):
    """torch 2.11's varlen_attn signature, computed per document with sdpa on any device."""

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1),
    ):  # fmt: skip
        assert tuple(window_size) == (-1, 0) and key.shape[1] == query.shape[1]
        assert max_q == int(cu_seq_q.diff().max())
        calls.append(len(cu_seq_q) - 1)
        out = torch.empty_like(query)
        bounds = cu_seq_q.tolist()
        for start, stop in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:stop].transpose(0, 1)[None] for t in (query, key, value))
            done = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale
            )
            out[start:stop] = done[0].transpose(0, 1)
        return out

    return varlen_attn


def per_document_logits_and_grads(model, rows: PackedRows, weights: torch.Tensor):
    """Each document alone through `model` (no mask, positions from 0): its logits placed at
    its positions, and the gradients of sum(weights * logits) over all documents."""
    model.zero_grad(set_to_none=True)
    logits = torch.zeros(*rows.input_ids.shape, model.config.vocab_size)
    total = 0.0
    for b in range(rows.input_ids.shape[0]):
        for doc in rows.document_ids[b].unique():
            where = (rows.document_ids[b] == doc).nonzero().flatten()
            alone = model(input_ids=rows.input_ids[b, where][None], use_cache=False).logits[0]
            total = total + (weights[b, where] * alone).sum()
            logits[b, where] = alone.detach()
    total.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def packed_logits_and_grads(model, rows: PackedRows, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(**packed_inputs(model, rows)).logits
    (weights * logits).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.numerics
@pytest.mark.parametrize("kernel", ["sdpa", "eager", "varlen"])
@pytest.mark.parametrize("layout", ["packed", "one_document"])
def test_packed_equals_each_document_alone_logits_and_gradients(
    tiny_model_dir, monkeypatch, kernel, layout
):
    """Logits within 1e-5, gradients within 5e-5 (float32 on a CPU; the kernels sum in other
    orders). `varlen` runs fnt's attention function with torch's varlen_attn replaced by a
    per-document stand-in of torch 2.11's signature (the real one is CUDA-only; the gpu-marked
    test below runs it)."""
    calls: list = []
    if kernel == "varlen":
        import torch.nn.attention.varlen as torch_varlen

        monkeypatch.setattr(torch_varlen, "varlen_attn", reference_varlen(calls))
        monkeypatch.setattr(
            attention, "_varlen_parameters", lambda: frozenset({"window_size", "return_aux"})
        )
    rows = packed_rows() if layout == "packed" else one_document_rows()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    weights = torch.randn(*rows.input_ids.shape, reference.config.vocab_size)
    alone, alone_grads = per_document_logits_and_grads(reference, rows, weights)
    model = load(tiny_model_dir, kernel)
    packed, packed_grads = packed_logits_and_grads(model, rows, weights)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(
            packed_grads[name], grad, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}"
        )
    if kernel == "varlen":
        layers = model.config.num_hidden_layers
        assert calls == [sum(map(len, row_layout(rows).document_lengths))] * layers


def test_decoding_switches_fnts_own_kernels_to_transformers_sdpa(tiny_model_dir):
    model = load(tiny_model_dir, "varlen")
    assert model.config._attn_implementation == "fnt_varlen"
    with decoding_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "fnt_varlen"
    eager = load(tiny_model_dir, "eager")
    with decoding_attention(eager):
        assert eager.config._attn_implementation == "eager"


def test_the_varlen_function_refuses_a_forward_without_boundaries(tiny_model_dir):
    model = load(tiny_model_dir, "varlen")
    with pytest.raises(ValueError, match="decoding_attention"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


# The kernels this machine's packages offer on CUDA (flash-attn is an optional package).
CUDA_KERNELS = [
    k for k in [*BOUNDARY_KERNELS, "flex", "sdpa"] if kernel_problem(k, "cuda", "bfloat16") is None
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", CUDA_KERNELS)
def test_packed_equals_alone_on_a_gpu(tiny_model_dir, kernel):
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=hf_attention_name(kernel)
    ).cuda()
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    for rows in (packed_rows(), one_document_rows()):
        device_rows = to_device(rows, torch.device("cuda"))
        with torch.no_grad():
            packed = model(**packed_inputs(model, device_rows)).logits.float()
            for b in range(rows.input_ids.shape[0]):
                for doc in rows.document_ids[b].unique():
                    where = (rows.document_ids[b] == doc).nonzero().flatten().cuda()
                    ids = device_rows.input_ids[b, where][None]
                    alone = reference(input_ids=ids, use_cache=False).logits.float()
                    torch.testing.assert_close(packed[b, where], alone[0], rtol=0.02, atol=0.02)


@pytest.mark.gpu
def test_flex_gradients_equal_sdpas_on_a_gpu(tiny_model_dir):
    """FlexAttention's backward (which a CPU lacks) against sdpa with the dense block mask, on
    the same packed rows, float32."""
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    rows = to_device(packed_rows(), torch.device("cuda"))
    flex_model, sdpa_model = (load(tiny_model_dir, k).cuda() for k in ("flex", "sdpa"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (*rows.input_ids.shape, flex_model.config.vocab_size)
    weights = torch.randn(shape, device="cuda", generator=generator)
    flex, flex_grads = packed_logits_and_grads(flex_model, rows, weights)
    sdpa, sdpa_grads = packed_logits_and_grads(sdpa_model, rows, weights)
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_a_run_records_the_kernel_and_compile_choice_its_device_made():
    cpu = with_device_choices(Config(model=ModelConfig()), "cpu")
    assert (cpu.model.attn_implementation, cpu.model.compile) == ("sdpa", False)
    assert cpu.model.loss_kernel == "eager"
    bf16 = Config(model=ModelConfig(compute_dtype="bfloat16"))
    cuda = with_device_choices(bf16, "cuda")
    assert cuda.model.attn_implementation == resolve_kernel("auto", "cuda", "bfloat16")
    assert cuda.model.compile is True
    with_ac = dataclasses.replace(bf16, model=dataclasses.replace(bf16.model, ac=True))
    assert with_device_choices(with_ac, "cuda").model.compile is False
    explicit = Config(model=ModelConfig(attn_implementation="eager", compile=True))
    assert with_device_choices(explicit, "cpu").model == dataclasses.replace(
        explicit.model, loss_kernel="eager"
    )
    with pytest.raises(ConfigError, match="'varlen' cannot run here: it runs on cuda only"):
        with_device_choices(Config(model=ModelConfig(attn_implementation="varlen")), "cpu")
    with pytest.raises(ConfigError, match="computes in bfloat16 or float16 only, not float32"):
        with_device_choices(Config(model=ModelConfig(attn_implementation="varlen")), "cuda")


def test_the_varlen_kernel_gets_one_16_bit_dtype():
    """Qwen3's float32 q/k norms under autocast leave query and key in float32 beside a
    bfloat16 value: the kernel's inputs take the 16-bit dtype (or autocast's)."""
    q, v = torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.bfloat16)
    assert attention.compute_dtype(q, q, v) == torch.bfloat16
    assert attention.compute_dtype(q, q, q) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.compute_dtype(q, q, q) == torch.bfloat16
