"""`fnt make-tiny-model` writes the same model on every machine: its weights do not depend on the
CPU kernels torch picks (ATEN_CPU_CAPABILITY), so numbers trained from it can be compared."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fnt.errors import ConfigError
from fnt.model import tiny_model
from fnt.store.transaction import written_by
from tests.e2e.helpers import REPO


@pytest.mark.numerics
def test_the_tiny_model_has_the_same_bits_under_another_kernel_family(tiny_model_dir, tmp_path):
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    subprocess.run(
        [sys.executable, "-m", "fnt", "make-tiny-model", "--out", str(tmp_path / "model")],
        cwd=REPO,
        env={**os.environ, "ATEN_CPU_CAPABILITY": other},
        check=True,
        capture_output=True,
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "model" / name).read_bytes() == (tiny_model_dir / name).read_bytes()


def test_weight_matrices_are_random_with_the_configured_spread_and_vectors_constant(
    tiny_model_dir,
):
    weights = load_file(tiny_model_dir / "model.safetensors")
    for name, tensor in weights.items():
        if tensor.dim() >= 2:
            assert abs(float(tensor.std()) - 0.02) < 1e-3, name  # config initializer_range
            assert abs(float(tensor.mean())) < 2e-3, name
        else:
            assert tensor.unique().numel() == 1, name  # norm weights: all ones


def test_a_tiny_model_replaces_the_one_written_before_but_no_other_directory(tmp_path):
    out = tmp_path / "model"
    tiny_model.main(["--out", str(out)])
    first = load_file(out / "model.safetensors")
    tiny_model.main(["--out", str(out), "--seed", "1"])
    second = load_file(out / "model.safetensors")
    assert written_by(out) == "fnt make-tiny-model"
    assert not all(torch.equal(first[name], second[name]) for name in first)
    (out / "COMPLETE").unlink()  # now a model some other program wrote
    with pytest.raises(ConfigError, match="did not write it"):
        tiny_model.main(["--out", str(out)])
    assert torch.equal(
        load_file(out / "model.safetensors")["lm_head.weight"], second["lm_head.weight"]
    )
