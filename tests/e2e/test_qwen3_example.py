"""The Qwen3-0.6B example configs (examples/qwen3/) run as written on a random-weight model of
the same architecture, shrunk (`fnt make-tiny-model --arch qwen3`), with the real Qwen3 chat
template and special tokens (tests/fixtures/chat_templates/qwen3.json): SFT, export, then RL
from the export. Only what a CPU test must change is overridden on the command line: the model
directory, the data paths, seq_len, the number of steps and the rollout's size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fnt.apps.export import export_hf_
from fnt.config import Config, RLConfig, validate
from fnt.config.loading import load_config, tomllib
from fnt.data.chat import ChatMasking, tokenize_conversation
from fnt.model import tiny_model
from fnt.model.tokenizer import stop_token_ids
from tests.e2e.helpers import REPO, config_args, read_metrics, run_cli

FIXTURE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen3.json"
SFT, RL = "examples/qwen3/sft.toml", "examples/qwen3/rl.toml"
# The shape of the session fixture `qwen3_dir` (tests/conftest.py).
SHRUNK = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 192,  # 3 x hidden, as Qwen3-0.6B's 3072 over 1024
}
SEQ_LEN, STEPS = "256", 2


@pytest.fixture(scope="module")
def reverse_data(tmp_path_factory) -> Path:
    """The reverse-text data the example configs name, written small by the same script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_data", REPO / "examples" / "reverse_text" / "make_data.py"
    )
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    out = tmp_path_factory.mktemp("qwen3_data")
    make_data.main(["--out", str(out), "--sft", "300", "--rl", "40", "--heldout", "1"])
    return out


def test_the_shrunk_model_is_qwen3_0_6b_s_architecture_with_its_template(qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    real = AutoConfig.for_model("qwen3", **tiny_model.QWEN3_0_6B)
    shrunk = AutoConfig.from_pretrained(qwen3_dir)
    for key in ("hidden_act", "rms_norm_eps", "attention_bias", "tie_word_embeddings"):
        assert getattr(shrunk, key) == getattr(real, key), key
    assert shrunk.rope_parameters == real.rope_parameters  # rope theta 1e6
    for key, size in SHRUNK.items():
        assert getattr(shrunk, key) == size, key
    # Heads twice as wide in total as the hidden size, as 16 x 128 over 1024.
    assert shrunk.head_dim * shrunk.num_attention_heads == 2 * shrunk.hidden_size
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "q_norm" in dict(model.model.layers[0].self_attn.named_children())

    fixture = json.loads(FIXTURE.read_text())
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    assert tok.chat_template == fixture["chat_template"]
    assert tok.eos_token == fixture["eos_token"] and tok.pad_token == fixture["pad_token"]
    assert len(tok) == shrunk.vocab_size
    for token in fixture["additional_special_tokens"]:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    stops = json.loads((qwen3_dir / "generation_config.json").read_text())["eos_token_id"]
    assert stops == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    chat = [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]
    masking = ChatMasking(stop_ids=stop_token_ids(tok, qwen3_dir))
    ((ids, targets),) = tokenize_conversation(chat, tok, masking)
    answer = tok.decode([i for i, t in zip(ids, targets) if t])
    # Qwen3's template renders an empty think block, which the model did not write.
    assert "<think>\n\n</think>\n\n" in tok.decode(ids) and answer == "cba<|im_end|>"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_example_configs_are_valid_on_1_to_8_gpus(world_size):
    """What the files' comments promise: the batch and prompt counts divide over 1-8 ranks."""
    for config_file, cls in ((SFT, Config), (RL, RLConfig)):
        config, _ = load_config(["--config", str(REPO / config_file)], cls)
        validate(config, world_size)


def file_values(config_file: str) -> dict:
    with open(REPO / config_file, "rb") as fh:
        return tomllib.load(fh)


def assert_ran_as_written(out: Path, config_file: str, overridden: set[str]) -> list[dict]:
    """One finite row per step, and every value of the file not overridden in the run's config."""
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss/mean"]) for r in rows)
    resolved = json.loads((out / "config.json").read_text())
    for section, values in file_values(config_file).items():
        if not isinstance(values, dict):
            values, resolved_section, section = {section: values}, resolved, ""
        else:
            resolved_section = resolved[section]
        for key, value in values.items():
            dotted = f"{section}.{key}" if section else key
            if dotted in overridden:
                continue
            got = resolved_section[key]
            if key == "sources":
                got = [{"path": s["path"]} for s in got]
            assert got == (list(value) if isinstance(value, (list, tuple)) else value), dotted
    return rows


def test_the_qwen3_example_configs_run_on_the_shrunk_model(qwen3_dir, reverse_data, tmp_path):
    assert file_values(SFT)["model"]["compute_dtype"] == "bfloat16"
    assert file_values(SFT)["seq_len"] == 4096 and file_values(RL)["seq_len"] == 4096
    sft_out, rl_out = tmp_path / "sft", tmp_path / "rl"
    sources = json.dumps([{"path": str(reverse_data / "sft.jsonl")}])
    small = ("--seq-len", SEQ_LEN, "--max-steps", str(STEPS))
    run_cli("sft", *config_args(SFT, qwen3_dir, sft_out, *small, "--data.sources", sources))
    overridden = {"model.name", "output_dir", "seq_len", "max_steps", "data.sources"}
    rows = assert_ran_as_written(sft_out, SFT, overridden)
    assert rows[0]["optim/lr"] == pytest.approx(1e-5 / 8)  # warmup step 1 of 8
    assert all(r["data/loss_tokens"] > 0 for r in rows)

    hf = export_hf_(sft_out / "checkpoints" / f"step_{STEPS}", tmp_path / "sft-hf")
    exported = AutoModelForCausalLM.from_pretrained(hf)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert not torch.equal(exported.model.embed_tokens.weight, base.model.embed_tokens.weight)

    rollout = (
        "--rollout.prompts",
        str(reverse_data / "rl.jsonl"),
        "--rollout.prompts-per-step",
        "4",
        "--rollout.group-size",
        "2",
        "--rollout.max-new-tokens",
        "12",
    )
    run_cli("rl", *config_args(RL, hf, rl_out, *small, *rollout))
    overridden |= {"rollout.prompts", "rollout.prompts_per_step", "rollout.group_size"}
    overridden |= {"rollout.max_new_tokens"}
    rows = assert_ran_as_written(rl_out, RL, overridden)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)  # the similarity reward
