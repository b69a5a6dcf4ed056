"""model.compile: each decoder layer compiled in place (fnt.model.compile).

The fast tests compile nothing (torch compiles a layer on its first call): names, checkpoints,
refusals, the reference model, and the cache compiled layers decode with (run eagerly). The slow
ones compile: eager-vs-compiled losses of SFT and RL's update at a stated tolerance (marked
numerics), two ranks under FSDP2, what a row says about compiling, the bound on graphs over
RL's lengths and over decoding, greedy tokens of compiled decoding, and exact resume.

Tolerances (measured on the tiny model, 3 steps, CPU): float32 compiled losses equal eager ones
to the last bit there, and are compared at 1e-5 (inductor may fuse reductions in another order
on other CPUs); bfloat16 compute differed by 1.3e-4 and is compared at 2e-3 (bfloat16 has 8
mantissa bits: one rounding step of a loss near 5.5 is 0.03, the mean over 64 tokens shrinks it).
RL's update (float32, 3 steps at lr 1e-2 on one off-policy batch) is not bit-equal: the third
step's grad norm (6.6) differed by 1.8e-5 (2.7e-6 relative), the trained logprobs (about -5.5)
by up to 8.6e-6; compared at 2e-5 relative (1e-5 absolute) and 1e-5 + 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from fnt import Config, ModelConfig, fold, init_state, sft_source
from fnt.build import reference_model, save_state_
from fnt.config import (
    CkptConfig,
    ConfigError,
    LoraConfig,
    RLConfig,
    RLLossConfig,
    RuntimeConfig,
    validate,
)
from fnt.distributed.runtime import setup_trainer
from fnt.loop import run
from fnt.model.compile import (
    compile_layers_,
    compile_totals,
    eager_layers,
    graph_limit,
    is_compiled,
)
from fnt.model.decode_cache import LayerCursorCache, decode_cache
from fnt.model.loading import decoder_layers, load_hf_model
from fnt.rollout.sampling import generate
from fnt.store.rundir import METRICS_FILE, ckpt_root, step_dir
from fnt.testing import assert_resume_exact
from steps import sft_step

LORA = LoraConfig(rank=4)


def sft_config(model_dir, out, *, max_steps=3, **model) -> Config:
    return Config(
        model=ModelConfig(name=str(model_dir), **model),
        output_dir=str(out),
        max_steps=max_steps,
        batch_size=4,
        micro_batch_size=2,
        seq_len=64,
        ckpt=CkptConfig(interval=0, save_final=False),
        runtime=RuntimeConfig(num_threads=1),
    )


def losses(config: Config) -> list[float]:
    state = init_state(config, setup_trainer(config))
    return [float(m["loss/mean"]) for _, m in fold(state, sft_source, sft_step, config.max_steps)]


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from fnt.testing.properties import _model_tensors

    return _model_tensors(directory)


@pytest.mark.parametrize("lora", [LoraConfig(), LORA])
def test_compiled_layers_keep_the_eager_names_in_state_dicts_and_checkpoints(
    tiny_model_dir, tmp_path, lora
):
    states = {}
    for compiled in (False, True):
        config = dataclasses.replace(
            sft_config(tiny_model_dir, tmp_path / str(compiled), lora=lora, compile=compiled),
            max_steps=1,
        )
        states[compiled] = init_state(config, setup_trainer(config))
    model = states[True].handles.model
    assert all(is_compiled(layer) for layer in decoder_layers(model))
    assert not any(is_compiled(layer) for layer in decoder_layers(states[False].handles.model))
    keys = list(model.state_dict())
    assert keys == list(states[False].handles.model.state_dict())
    assert not [k for k in keys if "_orig_mod" in k]
    saved = {}
    for compiled, state in states.items():
        save_state_(state)
        saved[compiled] = checkpoint_tensors(step_dir(ckpt_root(state.config.output_dir), 0))
    assert list(saved[True]) == list(saved[False])
    for name, tensor in saved[False].items():
        assert torch.equal(saved[True][name], tensor), name


def test_only_a_model_with_compiled_layers_switches_torchs_process_wide_stance(tiny_model_dir):
    """The stance is one for all threads: the uncompiled background copy of an async rollout
    decoding in eager_layers must leave it alone, or the update's compiled layers would run
    eagerly meanwhile (and for good, had the two blocks overlapped)."""
    from torch._dynamo import eval_frame

    model = load_hf_model(ModelConfig(name=str(tiny_model_dir)), torch.device("cpu"))
    with eager_layers(model):
        assert eval_frame._stance.stance == "default"
    compile_layers_(decoder_layers(model))
    with eager_layers(model):
        assert eval_frame._stance.stance == "force_eager"
    assert eval_frame._stance.stance == "default"


def test_the_graph_limit_is_read_under_its_name_of_this_torch(monkeypatch):
    import types

    assert graph_limit() == torch._dynamo.config.recompile_limit
    older = types.SimpleNamespace(cache_size_limit=5)  # torch 2.6 had no recompile_limit
    monkeypatch.setattr(torch._dynamo, "config", older)
    assert graph_limit() == 5


def test_compile_with_activation_checkpointing_is_refused_in_one_line(tiny_model_dir, tmp_path):
    config = sft_config(tiny_model_dir, tmp_path, compile=True, ac=True)
    with pytest.raises(ConfigError) as error:
        validate(config, world_size=1)
    message = str(error.value)
    assert message.startswith("'model.compile' = True: not with model.ac") and "\n" not in message
    validate(dataclasses.replace(config, model=dataclasses.replace(config.model, ac=False)), 1)


def test_the_reference_model_is_compiled_with_the_policy(tiny_model_dir, tiny_reference_dir):
    config = RLConfig(
        model=ModelConfig(name=str(tiny_model_dir), compile=True),
        loss=RLLossConfig(ref_kl_tau=0.1, ref_source="model", ref_model=str(tiny_reference_dir)),
    )
    runtime = setup_trainer(config)
    policy = load_hf_model(config.model, runtime.device)
    reference = reference_model(config, runtime, policy)
    assert reference is not policy
    assert all(is_compiled(layer) for layer in decoder_layers(reference))


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 40))]


def sample(model, **options) -> list[list[tuple[int, ...]]]:
    """Two completions of each of PROMPTS; rows stop at token 0 or their own limit."""
    return [
        [c.token_ids for c in completions]
        for completions in generate(
            model.eval(),
            PROMPTS,
            num_samples=2,
            max_new_tokens=[24, 9, 16],
            stop_token_ids=[0],
            **options,
        )
    ]


def test_compiled_layers_decode_with_the_cursor_cache_and_its_tokens_are_the_eager_ones(
    policy_dir,
):
    """The cache compiled layers decode with, run eagerly here (nothing compiles): the tokens
    of transformers' DynamicCache, greedy and sampled, with rows leaving the batch (each prompt
    has its own limit)."""
    model = load_hf_model(ModelConfig(name=str(policy_dir)), torch.device("cpu"))
    assert isinstance(decode_cache(model, 64), DynamicCache)

    def both(**options):
        return sample(model, greedy=True), sample(model, generators=generators(), **options)

    def generators():
        return [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]

    eager = both()
    compile_layers_(decoder_layers(model))
    assert isinstance(decode_cache(model, 64), LayerCursorCache)
    before = compile_totals()
    with torch.compiler.set_stance("force_eager"):
        assert both() == eager
    assert compile_totals().graphs == before.graphs


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize(
    "model, tolerance",
    [({}, 1e-5), ({"lora": LORA}, 1e-5), ({"compute_dtype": "bfloat16"}, 2e-3)],
    ids=["float32", "lora", "bfloat16"],
)
def test_compiled_sft_matches_eager_within_the_stated_tolerance(
    tiny_model_dir, tmp_path, model, tolerance
):
    eager = losses(sft_config(tiny_model_dir, tmp_path / "eager", **model))
    compiled = losses(sft_config(tiny_model_dir, tmp_path / "compiled", compile=True, **model))
    assert compiled == pytest.approx(eager, abs=tolerance)


@pytest.mark.slow
def test_rows_say_what_compiled_and_fixed_sft_rows_compile_only_once(tiny_model_dir, tmp_path):
    torch.compiler.reset()  # a graph an earlier test compiled in this process would be reused
    config = sft_config(tiny_model_dir, tmp_path, compile=True)
    run(config, sft_step, sft_source)
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["time/compile"] >= 0 for r in rows)
    assert rows[0]["perf/compile_graphs"] >= 1 and rows[0]["time/compile"] > 0
    assert [r["perf/compile_graphs"] for r in rows[1:]] == [0.0, 0.0]
    assert [r["time/compile"] for r in rows[1:]] == [0.0, 0.0]


@pytest.mark.slow
def test_rl_shaped_micro_batches_compile_a_bounded_number_of_graphs(tiny_model_dir):
    from fnt.batch import block_causal_mask

    torch.compiler.reset()
    model = load_hf_model(ModelConfig(name=str(tiny_model_dir)), torch.device("cpu"))
    compile_layers_(decoder_layers(model))
    before = compile_totals()
    # (rows, row length): lengths in multiples of ROW_MULTIPLE, row counts that fill a budget
    for rows, length in [(2, 64), (4, 32), (1, 128), (3, 40), (8, 16), (2, 200), (1, 256)]:
        ids = torch.randint(0, 100, (rows, length))
        documents = (torch.arange(length) >= length // 2).long().expand(rows, length)
        positions = torch.arange(length).expand(rows, length)
        out = model(
            input_ids=ids,
            attention_mask=block_causal_mask(documents),
            position_ids=positions,
            use_cache=False,
        )
        out.logits.float().logsumexp(-1).mean().backward()
    graphs = compile_totals().graphs - before.graphs
    assert 1 <= graphs <= 3 < graph_limit()


@pytest.mark.slow
def test_sft_resumes_exactly_with_compiled_layers(tiny_model_dir, tmp_path):
    config = dataclasses.replace(
        sft_config(tiny_model_dir, tmp_path / "unused", max_steps=4, compile=True),
        ckpt=CkptConfig(interval=1, keep_last=2),
    )
    assert_resume_exact(config, sft_step, sft_source, "step@3", workdir=tmp_path / "resume")


@pytest.mark.slow
@pytest.mark.numerics
def test_compiled_rl_step_matches_eager_within_the_stated_tolerance(tiny_model_dir):
    from fnt.config import OptimConfig
    from steps.rl import rl_step
    from tests.steps.test_rl_step import RL_KEYS, T, own_logprobs, random_rows, rl_batch

    torch.compiler.reset()
    rows = random_rows(0)
    # The start policy's logprobs as the inference engine's, for every step: off-policy after
    # the first, so the DPPO masks and the mismatch metrics take part too.
    start = load_hf_model(ModelConfig(name=str(tiny_model_dir)), torch.device("cpu"))
    batch = rl_batch(rows, own_logprobs(start, rows), size=2)
    seen = {}
    for compiled in (False, True):
        config = RLConfig(
            model=ModelConfig(name=str(tiny_model_dir), compile=compiled),
            optim=OptimConfig(lr=1e-2, max_norm=1.0),
            max_steps=3,
            seq_len=T,
        )
        state = init_state(config, setup_trainer(config))
        steps = []
        for _ in range(3):
            state, metrics = rl_step(state, batch)
            steps.append({k: float(metrics[k]) for k in sorted(RL_KEYS)})
        with eager_layers(state.handles.model):  # the trained weights, no no-grad graph
            seen[compiled] = steps, own_logprobs(state.handles.model, rows)
    assert all(is_compiled(layer) for layer in decoder_layers(state.handles.model))
    (eager_steps, eager_logprobs), (compiled_steps, compiled_logprobs) = seen[False], seen[True]
    assert eager_steps[2]["optim/grad_norm"] > 0  # it trained
    for eager, compiled in zip(eager_steps, compiled_steps):
        assert compiled == pytest.approx(eager, rel=2e-5, abs=1e-5)
    torch.testing.assert_close(compiled_logprobs, eager_logprobs, rtol=1e-5, atol=1e-5)


def fsdp_compile_job(fixture, out):
    return {
        "call": "tests.e2e.compile_ranks_loop:main",
        "args": [str(out), str(fixture("tiny_model_dir"))],
    }


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.two_ranks(job=fsdp_compile_job)
def test_two_rank_fsdp2_with_compiled_layers_matches_eager(two_rank_runs):
    """Layers compiled, then sharded: the eager names and shapes, and eager's losses and grad
    norms to 1e-5 (float32; measured: losses equal, grad norms within 6e-8)."""
    run = two_rank_runs(fsdp_compile_job)
    for rank in (0, 1):
        report = json.loads((run / f"rank{rank}.json").read_text())
        eager, compiled = report["eager"], report["compiled"]
        assert compiled["compiled"] and compiled["sharded"] and eager["sharded"]
        assert not eager["compiled"]
        assert compiled["names"] == eager["names"]
        assert not [name for name, _ in compiled["names"] if "_orig_mod" in name]
        assert eager["steps"][0] != eager["steps"][-1]  # it trained
        for got, want in zip(compiled["steps"], eager["steps"]):
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_tokens_in_a_bounded_number_of_graphs(policy_dir):
    """Decoding runs the compiled layers (prefill runs them eagerly): greedy tokens equal to the
    eager model's, and a handful of graphs for all layers and every batch size, prompt width
    and cache length (measured: 2, the second when the cache length first changes)."""
    torch.compiler.reset()
    model = load_hf_model(ModelConfig(name=str(policy_dir)), torch.device("cpu"))
    shapes = [{}, {"max_new_tokens": 12}, {"num_samples": 4, "max_new_tokens": 20}]
    options = [dict({"num_samples": 2, "max_new_tokens": 24}, **shape) for shape in shapes]

    def greedy(prompts, num_samples, max_new_tokens):
        groups = generate(
            model.eval(),
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            stop_token_ids=[0],
            greedy=True,
        )
        return [[c.token_ids for c in completions] for completions in groups]

    prompt_sets = [PROMPTS, PROMPTS[:2], [list(range(50, 90)), [7, 8]]]
    eager = [greedy(p, **o) for p, o in zip(prompt_sets, options)]
    compile_layers_(decoder_layers(model))
    before = compile_totals()
    assert [greedy(p, **o) for p, o in zip(prompt_sets, options)] == eager
    graphs = compile_totals().graphs - before.graphs
    assert 1 <= graphs <= 3 < graph_limit()
    again = compile_totals()
    assert greedy(prompt_sets[0], **options[0]) == eager[0]
    assert compile_totals().graphs == again.graphs


# The same checks on a GPU, where compiling pays most (scripts/gpu_check.sh measures it): CUDA's
# compiled kernels round differently from the eager ones, hence a float tolerance, and bf16's
# wider one.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "model, tolerance",
    [({}, 1e-4), ({"compute_dtype": "bfloat16"}, 5e-3)],
    ids=["float32", "bfloat16"],
)
def test_compiled_sft_on_cuda_matches_eager(tiny_model_dir, tmp_path, model, tolerance):
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    eager = losses(sft_config(tiny_model_dir, tmp_path / "eager", **model))
    compiled = losses(sft_config(tiny_model_dir, tmp_path / "compiled", compile=True, **model))
    assert compiled == pytest.approx(eager, abs=tolerance)


@pytest.mark.gpu
def test_compiled_decoding_on_cuda_gives_the_eager_tokens(policy_dir):
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked: needs CUDA")
    torch.compiler.reset()
    model = load_hf_model(ModelConfig(name=str(policy_dir)), torch.device("cuda")).eval()

    def greedy():
        groups = generate(
            model, PROMPTS, num_samples=2, max_new_tokens=24, stop_token_ids=[0], greedy=True
        )
        return [[c.token_ids for c in completions] for completions in groups]

    eager = greedy()
    compile_layers_(decoder_layers(model))
    before = compile_totals()
    assert greedy() == eager
    assert 1 <= compile_totals().graphs - before.graphs <= 3
