"""LoRA SFT end to end: the loss falls while the base stays bit-identical, the checkpoint holds
only what trains, resume is exact (after a crash, a SIGKILL during a save, at two ranks), a
changed base is refused, and the exports (the PEFT adapter, the merged model) give the trained
model's logits, on the tiny model and on the shrunk Qwen3."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from fnt import fold, init_state, setup_trainer, sft_source
from fnt.apps.export import export_hf_, load_trained_model
from fnt.build import save_state_
from fnt.config import Config, DataConfig, LoraConfig, ModelConfig, OptimConfig
from fnt.errors import CheckpointError
from fnt.model.lora import ADAPTER_CONFIG_FILE, base_name, is_adapter_weight
from fnt.obs.metrics import to_floats
from fnt.rollout.publish import PUBLISHED_FILE
from steps import sft_step
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    model_weights,
    read_metrics,
    run_cli,
    run_killed,
)
from tests.e2e.lora_ranks_loop import PROBE
from tests.e2e.lora_ranks_loop import K as JOB_K
from tests.e2e.lora_ranks_loop import N as JOB_N

N, K = 6, 3
LORA = ("--model.lora.rank", "8", "--model.lora.dropout", "0.1")
EXACT_KEYS = ("loss/mean", "optim/grad_norm", "optim/lr", "progress/num_tokens")


def args(model_dir, out, *extra):
    return config_args(
        "examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *LORA, *extra
    )


def dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def assert_base_unchanged(model, model_dir, cast=None) -> None:
    """Every frozen parameter of `model` equals the base's (rounded to `cast`, if given)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen
    for name, param in frozen:
        want = base[base_name(name)]
        assert torch.equal(param.detach(), want if cast is None else want.to(cast)), name


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    run_cli("sft", *args(tiny_model_dir, out, "--ckpt.interval", "2"))
    return out


def test_a_lora_run_lowers_the_loss_and_leaves_the_base_bit_identical(
    uninterrupted, tiny_model_dir
):
    rows = read_metrics(uninterrupted)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    assert rows[-1]["loss/mean"] < rows[0]["loss/mean"]
    model = load_trained_model(uninterrupted / "checkpoints" / f"step_{N}")
    assert_base_unchanged(model, tiny_model_dir)
    moved = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert moved and all(p.abs().max() > 0 for p in moved)  # every adapter trained


def test_the_checkpoint_holds_the_adapters_and_their_moments_only(
    uninterrupted, tiny_model_dir, tmp_path
):
    ckpt = uninterrupted / "checkpoints" / f"step_{N}"
    weights = model_weights(ckpt, tmp_path)
    assert weights and all(is_adapter_weight(name) for name in weights)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == 8 and meta["base_fingerprint"]

    full = tmp_path / "full"
    run_cli(
        "sft", *config_args("examples/debug/sft.toml", tiny_model_dir, full, "--max-steps", "1")
    )
    ratio = dir_bytes(ckpt) / dir_bytes(full / "checkpoints" / "step_1")
    assert ratio < 0.35, ratio  # rank 8 on a hidden size of 64: a third of the weights at most


@pytest.mark.numerics
# At two ranks: test_two_ranks_train_only_the_adapters_resume_exactly_and_publish.
@pytest.mark.parametrize("model", ["tiny_model_dir", "qwen3_dir"], ids=["tiny", "qwen3"])
def test_k_steps_then_resume_equals_n_steps(request, tmp_path, model):
    model_dir = request.getfixturevalue(model)
    full = tmp_path / "full"
    run_cli("sft", *args(model_dir, full, "--ckpt.interval", str(K)))
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    run_cli("sft", *args(model_dir, resumed, "--resume", "latest"))
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)


@pytest.mark.numerics
def test_sigkill_during_a_save_resumes_to_the_uninterrupted_run(
    tiny_model_dir, tmp_path, uninterrupted
):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out, "--ckpt.interval", "2"), fault="shards@4")
    assert (out / "checkpoints" / "step_4.partial").is_dir()
    run_cli("sft", *args(tiny_model_dir, out, "--ckpt.interval", "2", "--resume", "latest"))
    assert_resumed_run_matches(uninterrupted, out, 2, N, EXACT_KEYS, tmp_path)


def test_a_changed_base_is_refused_by_resume_and_export(tiny_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    out = tmp_path / "run"
    run_cli("sft", *args(base, out, "--max-steps", "2"))
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))

    proc = run_cli("sft", *args(base, out, "--resume", "latest"), check=False)
    assert proc.returncode == 2
    assert "holds LoRA adapters of the base model" in proc.stderr
    assert "fingerprint" in proc.stderr and "resume_force" in proc.stderr
    with pytest.raises(CheckpointError, match="has changed since"):
        export_hf_(out / "checkpoints" / "step_2", tmp_path / "hf")


@pytest.mark.parametrize(
    "extra, cast, adapter_dtype",
    [
        ({"model": {"compute_dtype": "bfloat16"}}, None, torch.float32),
        ({"model": {"ac": True}}, None, torch.float32),
        # bfloat16 compute copies of the adapters; the CPU AdamW's masters are float32
        ({"optim": {"impl": "native", "offload": "full"}}, torch.bfloat16, torch.bfloat16),
        ({"model": {"dtype": "bfloat16"}}, torch.bfloat16, torch.float32),
    ],
    ids=["bf16-compute", "activation-checkpointing", "full-offload", "bf16-base"],
)
def test_lora_trains_with_bf16_compute_checkpointing_offload_and_a_bf16_base(
    tiny_model_dir, extra, cast, adapter_dtype
):
    model = {"name": str(tiny_model_dir), "lora": LoraConfig(rank=8), **extra.get("model", {})}
    optim = {"lr": 1e-2, **extra.get("optim", {})}
    config = Config(
        model=ModelConfig(**model),
        optim=OptimConfig(**optim),
        max_steps=6,
        batch_size=8,
        micro_batch_size=4,
        seq_len=32,
        data=DataConfig(kind="synthetic"),
    )
    state = init_state(config, setup_trainer(config))
    losses = [to_floats(m)["loss/mean"] for state, m in fold(state, sft_source, sft_step, 6)]
    assert losses[-1] < losses[0], losses
    assert_base_unchanged(state.handles.model, tiny_model_dir, cast)
    trained = [p for p in state.handles.model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == adapter_dtype for p in trained)


@pytest.fixture(scope="module", params=["tiny", "qwen3"])
def trained(request, tmp_path_factory):
    """A LoRA model trained 8 steps in this process (rank 8 on every linear layer), its final
    checkpoint, its losses and its logits on a probe batch."""
    model_dir = request.getfixturevalue(
        "tiny_model_dir" if request.param == "tiny" else "qwen3_dir"
    )
    out = tmp_path_factory.mktemp(f"lora_{request.param}")
    config = Config(
        output_dir=str(out),
        model=ModelConfig(name=str(model_dir), lora=LoraConfig(rank=8, alpha=16.0)),
        optim=OptimConfig(lr=2e-2),
        max_steps=8,
        batch_size=8,
        micro_batch_size=4,
        seq_len=32,
        data=DataConfig(kind="synthetic"),
    )
    state = init_state(config, setup_trainer(config))
    losses = [to_floats(m)["loss/mean"] for state, m in fold(state, sft_source, sft_step, 8)]
    ckpt = save_state_(state)
    model = state.handles.model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    return {"dir": model_dir, "ckpt": ckpt, "losses": losses, "logits": logits, "model": model}


def test_training_lowers_the_loss_and_keeps_the_base(trained):
    assert trained["losses"][-1] < trained["losses"][0] - 0.05, trained["losses"]
    assert_base_unchanged(trained["model"], trained["dir"])


@pytest.mark.numerics
def test_the_adapter_export_loads_in_peft_with_the_trained_logits(trained, tmp_path):
    run_cli("export", "--checkpoint", str(trained["ckpt"]), "--out", str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(trained["dir"])
    base = AutoModelForCausalLM.from_pretrained(trained["dir"])
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = model(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained["logits"], rtol=0, atol=1e-6)


@pytest.mark.numerics
def test_the_merged_export_has_the_trained_logits_through_from_pretrained(trained, tmp_path):
    out = tmp_path / "merged"
    run_cli("export", "--checkpoint", str(trained["ckpt"]), "--out", str(out), "--merge")
    assert not (out / ADAPTER_CONFIG_FILE).exists()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name, _ in model.named_parameters())
    if model.config.tie_word_embeddings:  # Qwen3's head stays tied to the embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        got = model(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained["logits"], rtol=0, atol=1e-5)


def lora_ranks_job(fixture, out):
    return {
        "call": "tests.e2e.lora_ranks_loop:main",
        "args": [str(out), str(fixture("tiny_model_dir"))],
    }


@pytest.mark.numerics
@pytest.mark.two_ranks(job=lora_ranks_job)
def test_two_ranks_train_only_the_adapters_resume_exactly_and_publish(
    tiny_model_dir, two_rank_runs, tmp_path
):
    run = two_rank_runs(lora_ranks_job)
    reports = [json.loads((run / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        # FSDP2 made gradients for the adapters only; the optimizer holds nothing else.
        assert report["with_grad"] == report["trainable"]
        assert all(is_adapter_weight(name) for name in report["trainable"])
        assert report["frozen"] > 0 and report["optimizer_state_of_frozen"] == 0
        assert report["optimized_are_trainable"]
        assert report["resumed_from"] == JOB_K
        assert report["resumed"] == report["full"][JOB_K:], report  # bit-equal losses, norms
    final = f"step_{JOB_N}"
    full = model_weights(run / "full" / "checkpoints" / final, tmp_path)
    resumed = model_weights(run / "resumed" / "checkpoints" / final, tmp_path)
    assert full.keys() == resumed.keys() and all(is_adapter_weight(n) for n in full)
    for name in full:
        assert torch.equal(full[name], resumed[name]), name

    trained_logits = torch.load(run / "logits.pt")
    adapter = run / "adapter" / "weights" / final
    assert json.loads((adapter / PUBLISHED_FILE).read_text()) == {"kind": "adapter", "step": JOB_N}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, adapter).eval()(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)
    merged = run / "merged" / "weights" / final
    assert json.loads((merged / PUBLISHED_FILE).read_text())["kind"] == "merged"
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=PROBE).logits
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)
