"""The TRL/transformers names users type get fnt's key in the unknown-key message; names with
no fnt key get a sentence; typos get the nearest key (issue 45, item 8)."""

from __future__ import annotations

import re

import pytest

from fnt.config import ConfigError, load_config
from fnt.config.aliases import ALIASES, NO_EQUIVALENT, aliases_of, edit_distance
from fnt.config.schema import Config, DPOConfig, RLConfig, all_keys

KEYS = set(all_keys(Config)) | set(all_keys(RLConfig)) | set(all_keys(DPOConfig))


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_alias_names_a_key_fnt_has(alias):
    for entry in aliases_of(alias):
        assert entry.key in KEYS, (alias, entry.key)


def test_the_two_tables_do_not_share_a_name_and_their_words_name_real_keys():
    assert not set(ALIASES) & set(NO_EQUIVALENT)
    texts = list(NO_EQUIVALENT.values()) + [a.note for n in ALIASES for a in aliases_of(n)]
    for text in texts:
        for word in re.findall(r"\b(?:[a-z_]+\.)+[a-z_]+\b", text):
            assert word.endswith(".jsonl") or word in KEYS, (word, text)


def message(argv: list[str], cls: type = Config) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, cls)
    return str(info.value)


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        # The issue: these suggested optim.name, trace_steps, or nothing.
        ("optim.learning_rate", "did you mean 'optim.lr'?"),
        ("learning_rate", "did you mean 'optim.lr'?"),
        ("num_train_epochs", "did you mean 'max_epochs'? (resolved to a step count"),
        ("gradient_accumulation_steps", "did you mean 'batch_size'? (fnt counts batch_size as"),
        ("per_device_train_batch_size", "did you mean 'micro_batch_size'? (fnt counts"),
        ("warmup_steps", "did you mean 'schedule.warmup_steps'?"),
        ("max_grad_norm", "did you mean 'optim.max_norm'?"),
        ("weight_decay", "did you mean 'optim.weight_decay'?"),
        ("save_steps", "did you mean 'ckpt.interval'?"),
        ("logging_steps", "fnt writes a metrics row and a console line every step"),
    ],
)
def test_an_alias_is_answered_with_fnts_key(typed, expected):
    with pytest.raises(ConfigError) as info:
        load_config([f"--{typed}=1"])
    message = str(info.value)
    assert f"unknown key '{typed}'" in message and expected in message, message


@pytest.mark.parametrize(
    ("argv", "cls", "expected"),
    [
        # The examples, and what they said before.
        # was: did you mean 'data.kind'?
        (["--packing", "false"], Config, "unknown key 'packing' (command line); fnt always packs"),
        # was: did you mean 'data.chat_template'?
        (["--dataset_text_field", "text"], Config, "; fnt reads a column named text as plain text"),
        # were: no suggestion
        (["--bf16", "true"], Config, "did you mean 'model.compute_dtype' = \"bfloat16\"?"),
        (["--lora_r", "8"], Config, "did you mean 'model.lora.rank'? (LoRA is on when"),
        # was: unexpected argument 'runs/x'
        (["--bf16", "--output-dir", "runs/x"], Config, "unknown key 'bf16' (command line)"),
        (["--bf16"], Config, "unknown key 'bf16'"),
        # A switch written off gets the key's off value (was: the "on" value, bfloat16).
        (["--bf16", "false"], Config, "'model.compute_dtype' = \"float32\"? (the default"),
        (["--no_bf16"], Config, "'model.compute_dtype' = \"float32\"? (the default"),
        (["--no-tf32"], Config, "'runtime.matmul_precision' = \"highest\"? (the default"),
        (["--use_vllm", "0"], RLConfig, "'rollout.engine' = \"in_process\"? (the default"),
        # A name that means different things to DPO and GRPO: the command's key.
        (["--beta", "0.1"], DPOConfig, "did you mean 'dpo.beta'?"),
        (["--beta", "0.04"], RLConfig, "did you mean 'loss.ref_kl_tau'?"),
        (["--use_vllm"], RLConfig, "did you mean 'rollout.engine' = \"vllm\"?"),
        (["--fp16"], Config, 'model.compute_dtype = "bfloat16"'),
        # Typos: of an alias, of a key, under the wrong section, without a section.
        (["--learnng_rate", "1"], Config, "did you mean 'optim.lr'?"),
        (["--optim.learnng-rate", "1"], Config, "did you mean 'optim.lr'?"),
        (["--optim.min_lr", "0"], Config, "did you mean 'schedule.min_lr'?"),
        (["--model.rank", "8"], Config, "did you mean 'model.lora.rank'?"),
        (["--modelname", "x"], Config, "did you mean 'model.name'?"),
        (["--sed", "1"], Config, "did you mean 'seed'?"),
        (["--optim.esp", "1"], Config, "did you mean 'optim.eps'?"),
        (["--rolout.vlm.urls", "x"], RLConfig, "did you mean 'rollout.vllm.urls'?"),
    ],
)
def test_a_trl_users_flags_get_one_line_naming_what_to_type(argv, cls, expected):
    text = message(argv, cls)
    assert expected in text and "\n" not in text, text


def test_a_typo_in_a_files_section_ranks_that_sections_keys_first(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlearnng_rate = 1e-4\n")  # was: did you mean 'optim.name'?
    assert message(["--config", str(path)]).endswith(
        f"unknown key 'optim.learnng_rate' (file {path}); did you mean 'optim.lr'?"
    )


def test_a_name_far_from_every_key_gets_no_suggestion():
    assert message(["--optim.foo", "1"]) == "unknown key 'optim.foo' (command line)"
    assert message(["--zzzzzz", "1"]) == "unknown key 'zzzzzz' (command line)"


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("lrr", "lr", 1), ("esp", "eps", 1), ("kitten", "sitting", 3), ("", "ab", 2), ("a", "a", 0)],
)
def test_edit_distance(a, b, distance):
    assert edit_distance(a, b) == edit_distance(b, a) == distance
