"""Shared fixtures: tiny models written once per test session through the real maker script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make_model(out: Path, *extra: str) -> Path:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out), *extra],
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
