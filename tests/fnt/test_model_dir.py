"""Model directories are checked before transformers is called (issue 45.3): a truncated or
unreadable config.json, a model_type transformers has no causal LM for, missing weights or
shards, and damaged tokenizer files are one ConfigError naming the key, the directory and the
file; on the command line one `error:` line, exit 2, nothing written and transformers not
imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fnt.apps.preflight import check_generate, require_model_dir, require_tokenizer_files
from fnt.errors import CheckpointError, ConfigError
from fnt.model.directory import causal_lm_model_types, model_dir_problem
from tests.e2e.helpers import REPO


@pytest.fixture
def model(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model, to damage."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    for key, value in changes.items():
        if value is None:
            del config[key]
    (model / "config.json").write_text(json.dumps(config))


def error_of(model: Path, key: str = "model.name") -> str:
    with pytest.raises(ConfigError) as caught:
        require_model_dir(str(model), "command line", key=key)
    return str(caught.value)


def test_the_tiny_model_passes(model):
    assert model_dir_problem(str(model)) is None
    require_model_dir(str(model))
    require_tokenizer_files(str(model), "RL")


def test_transformers_table_is_read_without_importing_it():
    # The check must not degrade silently into no check: the table is found and holds the
    # architectures fnt's examples use.
    known = causal_lm_model_types()
    assert known is not None and {"llama", "qwen2", "qwen3", "qwen3_moe"} <= known
    assert "vit" not in known  # an image classifier: no causal LM


def test_truncated_config_names_key_directory_and_file(model):
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[: len(text) // 2])
    message = error_of(model, key="loss.ref_model")
    assert message.startswith(f"'loss.ref_model' = '{model}' (command line): config.json is not")
    assert "valid JSON (truncated?)" in message and "fetch the model's files again" in message


def test_config_not_an_object(model):
    (model / "config.json").write_text("[1, 2]\n")
    assert "config.json holds list, not a JSON object" in error_of(model)


def test_unreadable_config(model):
    (model / "config.json").write_bytes(b"\xff\xfe{")
    assert "config.json cannot be read" in error_of(model)


def test_unknown_model_type_and_no_model_type(model):
    edit_config(model, model_type="not-a-model", architectures=["NotAModelForCausalLM"])
    message = error_of(model, key="dpo.ref_model")
    assert message.startswith(f"'dpo.ref_model' = '{model}'")
    assert "model_type 'not-a-model' (architectures ['NotAModelForCausalLM'])" in message
    assert "no causal language model class" in message
    edit_config(model, model_type="vit")
    assert "model_type 'vit'" in error_of(model)
    edit_config(model, model_type=None)
    assert "config.json names no model_type" in error_of(model)


def test_missing_weights_and_missing_shards(model):
    (weights,) = model.glob("*.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": weights.name, "b": "model-00002-of-00002.safetensors"}})
    )
    message = error_of(model)
    assert "model.safetensors.index.json names 1 weight file(s) that are not there" in message
    assert "model-00002-of-00002.safetensors" in message
    (model / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert "model.safetensors.index.json is not valid JSON" in error_of(model)
    (model / "model.safetensors.index.json").unlink()
    weights.unlink()
    assert "no weights there (no *.safetensors or pytorch_model*.bin file)" in error_of(model)


def test_damaged_tokenizer_files(model):
    (model / "tokenizer_config.json").write_text('{"chat_template": "')
    with pytest.raises(ConfigError, match="tokenizer_config.json is not valid JSON.*RL needs"):
        require_tokenizer_files(str(model), "RL")


def test_generate_checks_a_model_directory(model):
    (model / "config.json").write_text('{"model_type": ')
    with pytest.raises(ConfigError, match=r"^--checkpoint '.*': config.json is not valid JSON"):
        check_generate(model, None)
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        check_generate(model.parent, None)


def test_cli_truncated_config_is_one_line_before_transformers(model, tmp_path):
    # A fresh interpreter, so that what it imports is the command's own doing.
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[:40])
    out = tmp_path / "runs" / "x"
    code = (
        "import sys\n"
        "from fnt.__main__ import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "finally:\n"
        "    print('imported transformers:', 'transformers' in sys.modules)\n"
    )
    args = ["sft", "--config", "examples/debug/sft.toml", "--model.name", str(model)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--output-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: 'model.name' = '{model}'"), lines
    assert "config.json is not valid JSON" in lines[0]
    assert "imported transformers: False" in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_a_checkpoints_damaged_base_model_is_named(tiny_model_dir, tmp_path):
    from tests.e2e.helpers import config_args, run_cli

    base = Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))
    out = tmp_path / "run"
    run_cli("sft", *config_args("examples/debug/sft.toml", base, out, "--max-steps", "1"))
    (base / "config.json").write_text('{"model_type": "llama", ')
    checkpoint = out / "checkpoints" / "step_1"
    for command in ("generate", "export"):
        extra = ("--prompt", "hi") if command == "generate" else ("--out", str(tmp_path / "hf"))
        proc = run_cli(command, "--checkpoint", str(checkpoint), *extra, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"its base model '{base}' (meta.json model_name): config.json is not valid JSON" in (
            proc.stderr
        )
