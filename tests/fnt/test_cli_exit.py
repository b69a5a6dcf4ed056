"""How a bad input ends a worker under torchrun: the error file first, then rank 0 prints and
the other ranks wait, so that a rank other than 0 never ends the job before rank 0's line."""

import json

import pytest

from fnt.apps import cli
from fnt.errors import ConfigError


def _exit(monkeypatch, tmp_path, rank):
    error_file = tmp_path / f"error_{rank}.json"
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    sleeps = []
    monkeypatch.setattr(cli.time, "sleep", sleeps.append)
    with pytest.raises(SystemExit) as exit_info, cli.exit_on_bad_input():
        raise ConfigError("'data.path' = 'x.jsonl': cannot read it")
    return exit_info.value.code, json.loads(error_file.read_text())["message"], sleeps


def test_rank_0_prints_the_line_and_exits_at_once(monkeypatch, tmp_path, capsys):
    code, message, sleeps = _exit(monkeypatch, tmp_path, rank=0)
    assert code == 2 and sleeps == []
    assert message == "error: 'data.path' = 'x.jsonl': cannot read it"
    assert capsys.readouterr().err == message + "\n"


def test_another_rank_leaves_the_line_for_the_report_and_gives_rank_0_time(
    monkeypatch, tmp_path, capsys
):
    code, message, sleeps = _exit(monkeypatch, tmp_path, rank=1)
    assert code == 2 and sleeps == [cli.OTHER_RANKS_EXIT_DELAY_S]
    assert message.startswith("error: 'data.path'")
    assert capsys.readouterr().err == ""
