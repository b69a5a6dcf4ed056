"""The `fnt` command line: `python -m fnt sft` alone and under torchrun, and bad input exiting 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, config_args, read_metrics, run_cli, run_script

SFT = "examples/debug/sft.toml"


def test_python_m_fnt_sft_writes_one_row_per_step(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = config_args(SFT, tiny_model_dir, out, "--max-steps", "3")
    run_script("fnt", "sft", *args, module=True)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


# Slow: the default suite has `python -m fnt` (above) and fnt's main under torchrun (every
# two-rank job of tests/two_ranks.py); this is the README's command as one piece.
@pytest.mark.slow
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


# Runs `fnt` in a fresh interpreter and reports, after it exits, its status and whether any
# module that builds a model or a process group was imported.
PROBE = """
import json, sys
from fnt.__main__ import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(
    m for m in ("fnt.build", "fnt.model.loading", "fnt.distributed.runtime", "fnt.loop") if m in
    sys.modules
)
print(json.dumps({"code": code, "heavy": heavy}))
"""


def _probe(*args: str):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _bad_inputs(tiny_model_dir, tmp_path):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, no_tokenizer)
    for file in no_tokenizer.iterdir():
        if file.name.startswith(("tokenizer", "vocab", "special_tokens")):
            file.unlink()
    not_json = tmp_path / "not-json.jsonl"
    not_json.write_text("\n{oops\n")
    no_completion = tmp_path / "no-completion.jsonl"
    no_completion.write_text('{"prompt": "hi"}\n')

    def sft(model, *extra):
        return ("sft", *config_args(SFT, model, tmp_path / "run", *extra))

    def jsonl(path):
        return ("--data.kind", "sources", "--data.sources", json.dumps([{"path": str(path)}]))

    rl = ("rl", *config_args("examples/debug/rl.toml", tiny_model_dir, tmp_path / "run"))
    return {
        "missing data file": (
            sft(tiny_model_dir, *jsonl(tmp_path / "missing.jsonl")),
            f"error: 'data.sources[0].path' = '{tmp_path / 'missing.jsonl'}': cannot read it: "
            "No such file or directory",
        ),
        "data line not JSON": (
            sft(tiny_model_dir, *jsonl(not_json)),
            f"error: {not_json}, line 2: invalid JSON at column 2: Expecting property name",
        ),
        "bad first record": (
            sft(tiny_model_dir, *jsonl(no_completion)),
            f"error: {no_completion}, line 1: a prompt/completion record needs key 'completion'",
        ),
        "missing tokenizer": (
            sft(no_tokenizer, *jsonl(no_completion)),
            f"error: 'model.name' = '{no_tokenizer}': no tokenizer files in the model directory",
        ),
        "missing prompts file": (
            (*rl, "--rollout.prompts", str(tmp_path / "missing.jsonl")),
            f"error: 'rollout.prompts' = '{tmp_path / 'missing.jsonl'}': cannot read it",
        ),
        "missing resume step": (
            sft(tiny_model_dir, "--resume", "7"),
            "error: resume = 7: no complete checkpoint step_7",
        ),
    }


BAD_INPUTS = [
    "missing data file",
    "data line not JSON",
    "bad first record",
    "missing tokenizer",
    "missing prompts file",
    "missing resume step",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_before_any_model_is_built(tiny_model_dir, tmp_path, case):
    args, message = _bad_inputs(tiny_model_dir, tmp_path)[case]
    result, stderr = _probe(*args)
    assert result == {"code": 2, "heavy": []}, stderr[-3000:]
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(message), stderr


def test_under_torchrun_only_rank_0_prints_a_bad_input_and_the_report_ends_with_it(
    tiny_model_dir, tmp_path
):
    """torchrun follows a failed worker with a failure report of its own; each worker leaves its
    `error:` line in torchrun's error file, so the report ends with that line."""
    args, message = _bad_inputs(tiny_model_dir, tmp_path)["missing data file"]
    proc = run_script("fnt", *args, nproc=2, check=False, module=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    (error,) = [line for line in lines if line.startswith("error: ")]
    assert message in error, proc.stderr[-3000:]
    assert lines[-1].startswith("=====") and lines[-2] == f"  traceback : {error}", lines[-12:]
    # The report's root cause (the first worker to fail) is the last entry; torchrun stops the
    # other worker then, which may end before writing its own line, so it may show a signal.
    assert proc.stderr.count(f"  traceback : {error}") >= 1
    assert "To enable traceback" not in proc.stderr


def test_the_installed_console_script_lists_the_commands():
    fnt = Path(sys.executable).parent / "fnt"
    assert fnt.is_file(), "no console script: reinstall with pip install -e ."
    proc = subprocess.run([fnt, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for command in ("sft", "rl", "export", "make-tiny-model"):
        assert f"\n  {command} " in proc.stdout
    bare = subprocess.run([fnt], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and "make-tiny-model" in bare.stderr


def test_sft_help_starts_with_a_usage_line_naming_config_print_config_and_help():
    proc = run_cli("sft", "--help")
    assert proc.returncode == 0
    first, *rest = proc.stdout.splitlines()
    assert first.startswith("usage: fnt sft [--config FILE.toml]")
    for flag in ("--config FILE.toml", "--print-config", "-h, --help, --help-config"):
        assert any(line.strip().startswith(flag) for line in rest), flag
    assert "--optim.lr (float" in proc.stdout
    assert run_cli("rl", "--help").stdout.startswith("usage: fnt rl ")


def test_fnt_version_prints_the_installed_version():
    from importlib.metadata import version

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fnt {version('fnt')}"


def test_help_into_a_closed_pipe_ends_without_a_traceback():
    """`fnt sft --help | head` when head has stopped reading: exit 1, nothing on stderr."""
    child = subprocess.Popen(
        [sys.executable, "-m", "fnt", "sft", "--help"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child.stdout.close()  # the reader is gone before the first line
    stderr = child.stderr.read().decode()
    child.wait(timeout=60)
    assert child.returncode == 1 and stderr == "", stderr


def test_export_help_answers_without_importing_torch():
    code = (
        "import sys\n"
        "from fnt.__main__ import main\n"
        "try:\n"
        "    main(['export', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("usage: fnt export")
    assert done.stdout.splitlines()[-1] == "False"
