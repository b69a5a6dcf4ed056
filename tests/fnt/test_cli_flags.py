"""Flags as a TRL user types them (issue 45, item 8): bare flags, `-h` on every command."""

from __future__ import annotations

import pytest

from fnt.__main__ import COMMANDS, main
from fnt.config import ConfigError, load_config
from fnt.config.loading import split_cli


def test_a_bare_flag_is_true_for_a_key_that_may_be_a_boolean():
    config, _ = load_config(["--model.compile", "--seed", "3"])  # bool | "auto"
    assert config.model.compile is True and config.seed == 3
    config, _ = load_config(["--max-steps", "2", "--model.compile"])
    assert config.model.compile is True
    assert load_config(["--model.compile", "auto"])[0].model.compile == "auto"
    assert load_config(["--model.ac", "--model.compile", "false"])[0].model.compile is False


def test_a_key_that_needs_a_value_does_not_take_the_next_option_as_one():
    with pytest.raises(ConfigError, match=r"^--output_dir \(command line\) needs a value$"):
        load_config(["--output_dir", "--max_steps", "3"])
    with pytest.raises(ConfigError, match=r"^--config \(command line\) needs a value$"):
        load_config(["--config", "--seed", "1"])


def test_an_unknown_bare_flag_is_named_and_the_rest_still_parses():
    cli = split_cli(["--bf16", "--output-dir", "runs/x", "--gradient_checkpointing"])
    assert cli.overrides == (
        ("bf16", "true"),
        ("output_dir", "runs/x"),
        ("gradient_checkpointing", "true"),
    )


@pytest.mark.parametrize("flag", ["-h", "--help", "--help-config"])
def test_help_wins_over_anything_else_on_the_line(flag):
    cli = split_cli(["--config", "missing.toml", "stray", flag, "--bogus"])
    assert cli.help_config and cli.config_file is None and cli.overrides == ()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_dash_h_with_its_usage(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "-h"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: fnt {command}")


def test_rl_list_environments_takes_dash_h_and_nothing_else(capsys):
    with pytest.raises(SystemExit) as info:
        main(["rl", "--list-environments", "-h"])
    assert info.value.code == 0 and "usage: fnt rl --list-environments" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["rl", "--list-environments", "--seed", "1"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --list-environments (command line) takes no other options: "
        "fnt rl --list-environments\n"
    )


def test_the_issues_command_line_is_one_error_line_and_exit_2_before_any_work(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "x"
    result = subprocess.run(
        [sys.executable, "-m", "fnt", "sft", "--bf16", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: unknown key 'bf16' (command line); did you mean")
    assert result.stderr.count("\n") == 1 and not out.exists()
