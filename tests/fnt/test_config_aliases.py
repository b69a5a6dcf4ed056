"""The TRL/transformers names users type get fnt's key in the unknown-key message."""

from __future__ import annotations

import pytest

from fnt.config import ConfigError, load_config
from fnt.config.aliases import ALIASES
from fnt.config.schema import Config, RLConfig, all_keys

KEYS = set(all_keys(Config)) | set(all_keys(RLConfig))


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_alias_names_a_key_fnt_has(alias):
    target, _ = ALIASES[alias]
    assert target is None or target in KEYS, (alias, target)


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
