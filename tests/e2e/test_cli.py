"""The `fnt` command line: `python -m fnt sft` alone and under torchrun, and bad input exiting 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from fnt.monitors import read_metrics
from tests.e2e.helpers import REPO, config_args, run_script

SFT = "examples/debug/sft.toml"


def test_python_m_fnt_sft_writes_one_row_per_step(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = config_args(SFT, tiny_model_dir, out, "--max-steps", "3")
    run_script("fnt", "sft", *args, module=True)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_torchrun_m_fnt_sft_at_two_ranks(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = config_args(SFT, tiny_model_dir, out, "--max-steps", "3")
    run_script("fnt", "sft", *args, nproc=2, timeout=240, module=True)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_a_missing_model_directory_exits_2_within_5_s_naming_key_path_and_fix(tmp_path):
    missing = tmp_path / "no-model"
    start = time.monotonic()
    args = config_args(SFT, missing, tmp_path / "run")
    proc = run_script("fnt", "sft", *args, check=False, module=True, timeout=30)
    assert time.monotonic() - start < 5
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: 'model.name' = '{missing}' (command line): ")
    assert "expected a directory with config.json" in proc.stderr
    assert f"fnt make-tiny-model --out {missing}" in proc.stderr


def test_the_rl_command_names_the_config_file_the_model_name_came_from(tmp_path):
    config = tmp_path / "rl.toml"
    text = (REPO / "examples" / "debug" / "rl.toml").read_text()
    config.write_text(text.replace('"runs/tiny-model"', f'"{tmp_path / "absent"}"'))
    proc = run_script("fnt", "rl", "--config", str(config), check=False, module=True, timeout=30)
    assert proc.returncode == 2
    assert f"'model.name' = '{tmp_path / 'absent'}' (file {config}): no Hugging Face" in proc.stderr


def test_a_data_error_exits_2_without_a_traceback(tiny_model_dir, tmp_path):
    sources = f'[{{"path": "{tmp_path / "missing.jsonl"}"}}]'
    args = config_args(SFT, tiny_model_dir, tmp_path / "run", "--data.kind", "jsonl")
    proc = run_script("fnt", "sft", *args, "--data.sources", sources, check=False, module=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and str(tmp_path / "missing.jsonl") in last_line
    assert "Traceback" not in proc.stderr


def test_the_installed_console_script_lists_the_commands():
    fnt = Path(sys.executable).parent / "fnt"
    assert fnt.is_file(), "no console script: reinstall with pip install -e ."
    proc = subprocess.run([fnt, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for command in ("sft", "rl", "export", "make-tiny-model"):
        assert f"\n  {command} " in proc.stdout
    bare = subprocess.run([fnt], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and "make-tiny-model" in bare.stderr
