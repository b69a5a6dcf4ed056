"""README.md's RL settings, one per need (its "RL, one setting per need"), are those of
examples/debug/rl_agentic.toml, which is a valid config whose environments build and pass
start-up's trial: so the block is config that runs, and it keeps one example per setting (issue
47's items: per-turn credit, mixtures, whole held-out episodes, importance-sampling corrections,
difficulty filtering, environments out of process, context that changes)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fnt.apps.preflight import check_rollout_data
from fnt.config import RLConfig, load_config, validate
from fnt.config.schema import IsolationConfig, all_keys

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- rl-settings:start -->\n```toml\n(.*?)```\n<!-- rl-settings:end -->", re.S)
CONFIG = "examples/debug/rl_agentic.toml"


def readme_settings() -> tuple[str, dict]:
    """The README's block of RL settings: its text and its table."""
    match = BLOCK.search((ROOT / "README.md").read_text())
    assert match, "README.md lost its RL settings block (rl-settings)"
    return match.group(1), tomllib.loads(match.group(1))


def leaves(table: dict, prefix: str = "") -> dict:
    """Every value of a TOML table by dotted key (a list of tables is one value)."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_the_readme_rl_settings_are_the_example_configs():
    _, table = readme_settings()
    example = leaves(tomllib.loads((ROOT / CONFIG).read_text()))
    shown = leaves(table)
    keys = set(all_keys(RLConfig))
    assert set(shown) <= keys, f"keys RLConfig does not have: {set(shown) - keys}"
    differ = {key: (value, example.get(key)) for key, value in shown.items()}
    assert {k: v for k, v in differ.items() if v[0] != v[1]} == {}


def test_the_readme_rl_settings_show_one_example_per_setting():
    text, table = readme_settings()
    shown = leaves(table)
    for key in (
        "rollout.credit",  # 1
        "rollout.environments",  # 2
        "val.samples",  # 3
        "loss.is_correction",  # 4
        "rollout.filter_groups",  # 5
        "rollout.isolation.workers",  # 6
    ):
        assert key in shown, key
    numbered = sorted(int(n) for n in re.findall(r"# (\d) ", text))
    assert numbered == [1, 2, 3, 4, 5, 6]
    after = (ROOT / "README.md").read_text().split("<!-- rl-settings:end -->")[1]
    assert after.lstrip().startswith("7: ") and "history=" in after.split("\n\n")[1]


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are the repository's
    monkeypatch.syspath_prepend(str(ROOT))  # PYTHONPATH=. as the example says


def test_the_example_config_is_valid_and_its_environments_start(at_root):
    config, _ = load_config(["--config", CONFIG], RLConfig)
    validate(config, 1)
    assert [e.name for e in config.rollout.environments] == ["hint", "three"]
    assert config.rollout.isolation.workers == 2
    # Each member built and tried on its first prompt, in this process (workers cost a second
    # each to start; tests/fnt/rollout/test_isolation.py starts mixtures in them, and the slow
    # tests/e2e/test_rl_agentic.py trains this config with them).
    in_process = dataclasses.replace(config.rollout, isolation=IsolationConfig())
    check_rollout_data(dataclasses.replace(config, rollout=in_process))
