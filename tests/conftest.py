"""Shared fixtures: tiny models written once per test session by `fnt make-tiny-model`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def make_model(out: Path, *extra: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "fnt", "make-tiny-model", "--out", str(out), *extra],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A dense Llama-shaped model (hidden 64, 2 layers) with a byte-level chat tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A Qwen3-MoE model (4 experts, top-2) with the same tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny_moe") / "model", "--moe")


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory) -> Path:
    """The dense tiny model with its LM head tied to the input embedding (`--tie`)."""
    return make_model(tmp_path_factory.mktemp("tiny_tied") / "model", "--tie")
