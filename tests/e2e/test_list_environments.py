"""`fnt rl --list-environments`: every environment of the table with how rollout.environment
names it and whether its extra is installed, an installed integration's names (reasoning-gym's
tasks), and each listed spelling routed back to its own entry."""

from __future__ import annotations

import importlib.util

from fnt.config.environments import ENVIRONMENTS, environment_kind
from tests.e2e.helpers import run_cli


def test_the_listing_names_every_environment_its_spelling_and_what_is_installed():
    proc = run_cli("rl", "--list-environments")
    assert proc.returncode == 0
    blocks = proc.stdout.strip().split("\n\n")
    assert [block.split(":")[0] for block in blocks] == [kind.name for kind in ENVIRONMENTS]
    for kind, block in zip(ENVIRONMENTS, blocks):
        assert f"rollout.environment = {kind.spelling}" in block
    by_name = dict(zip([k.name for k in ENVIRONMENTS], blocks))
    assert by_name["single_turn"].startswith("single_turn: built in")
    installed = by_name["reasoning_gym"]
    assert installed.startswith("reasoning_gym: installed (reasoning-gym ")
    from reasoning_gym.factory import DATASETS

    listed = " ".join(installed.split("names: ", 1)[1].split())
    assert listed.split(", ") == sorted(set(DATASETS) - {"composite"})


def test_a_missing_extra_is_listed_with_the_command_that_installs_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "reasoning_gym" else real(name, *a),
    )
    proc = run_cli("rl", "--list-environments")
    (block,) = [b for b in proc.stdout.strip().split("\n\n") if b.startswith("reasoning_gym:")]
    assert block.splitlines()[0] == "reasoning_gym: not installed: pip install 'fnt[tasks]'"
    assert "names:" not in block


def test_each_spelling_is_routed_to_its_entry():
    examples = {
        "single_turn": "",
        "factory": "my.module:make",
        "reasoning_gym": "reasoning_gym:gcd",
        "verifiers": "verifiers:my_tasks",
    }
    examples["reasoning_gym_mix"] = "reasoning_gym"
    for name, value in examples.items():
        assert environment_kind(value).name == name.removesuffix("_mix")
