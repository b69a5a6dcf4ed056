"""An environment mixture (rollout.environments) end to end: per-environment metrics on every
row, saved samples that name their environment, an exact resume; and a mixture of one
environment trains exactly as that environment alone."""

from __future__ import annotations

import json

from fnt.rollout.environments import SingleTurnEnvironment
from fnt.rollout.rewards import reward_function
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
)

PROMPTS = "examples/debug/prompts.jsonl"
EXACT = ("reward/mean", "reward/std", "loss/mean", "optim/grad_norm")
PER_ENVIRONMENT = ("rollout/letters/reward", "rollout/letters/episodes")


def letters(rollout):
    return SingleTurnEnvironment(reward_function("ascii_letters"))


def short(rollout):
    """1.0 for an empty answer, less the longer it is: a reward unlike `letters`'."""
    return SingleTurnEnvironment(lambda completion, record: 1.0 / (1.0 + len(completion)))


def mixture_toml(tmp_path, *members: tuple[str, str, float]) -> str:
    """examples/debug/rl.toml with rollout.environments in place of its prompts and reward."""
    base = open("examples/debug/rl.toml").read().splitlines()
    lines = [line for line in base if not line.startswith(("prompts =", "reward ="))]
    for name, factory, weight in members:
        lines += [
            "[[rollout.environments]]",
            f'name = "{name}"',
            f'environment = "tests.e2e.test_rl_mixture:{factory}"',
            f'prompts = "{PROMPTS}"',
            f"weight = {weight}",
        ]
    path = tmp_path / f"mixture_{len(members)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def rl_args(config, model_dir, out, *extra):
    return config_args(config, model_dir, out, "--max-steps", "4", *extra)


def test_a_mixture_logs_each_environment_saves_its_name_and_resumes_exactly(
    tiny_model_dir, tmp_path
):
    mixture = mixture_toml(tmp_path, ("letters", "letters", 3.0), ("short", "short", 1.0))
    full = tmp_path / "full"
    extra = ("--ckpt.interval", "2", "--rollout.log_samples_every", "1")
    run_cli("rl", *rl_args(mixture, tiny_model_dir, full, *extra))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    keys = {"rollout/letters/reward", "rollout/short/reward", "rollout/short/episodes"}
    for row in rows:
        assert keys <= row.keys()
        assert row["rollout/letters/episodes"] + row["rollout/short/episodes"] == 8
    samples = [
        json.loads(line)
        for path in sorted((full / "samples").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert {s["environment"] for s in samples} == {"letters", "short"}
    for row in rows:  # each environment's reward is the mean of its own saved samples' rewards
        mine = [s for s in samples if s["step"] == row["step"]]
        for name in ("letters", "short"):
            rewards = [s["reward"] for s in mine if s["environment"] == name]
            assert len(rewards) == row[f"rollout/{name}/episodes"]
            if rewards:
                assert abs(row[f"rollout/{name}/reward"] - sum(rewards) / len(rewards)) < 1e-12

    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *rl_args(mixture, tiny_model_dir, resumed, "--resume", "latest"))
    assert_resumed_run_matches(full, resumed, 2, 4, EXACT + PER_ENVIRONMENT, tmp_path)


def test_a_mixture_of_one_environment_trains_as_that_environment_alone(tiny_model_dir, tmp_path):
    alone = tmp_path / "alone"
    run_cli("rl", *rl_args("examples/debug/rl.toml", tiny_model_dir, alone, "--max-steps", "2"))
    mixed = tmp_path / "mixed"
    mixture = mixture_toml(tmp_path, ("letters", "letters", 1.0))
    run_cli("rl", *rl_args(mixture, tiny_model_dir, mixed, "--max-steps", "2"))
    for a, b in zip(read_metrics(alone), read_metrics(mixed), strict=True):
        for key in EXACT:
            assert a[key] == b[key], (a["step"], key)
        assert b["rollout/letters/reward"] == a["reward/mean"]


def test_each_environment_is_validated_on_its_own_held_out_prompts(tiny_model_dir, tmp_path):
    lines = open(PROMPTS).read().splitlines()
    held_out = {"letters": lines[:3], "short": lines[3:8]}
    mixture = mixture_toml(tmp_path, ("letters", "letters", 3.0), ("short", "short", 1.0))
    text = open(mixture).read()
    for name, records in held_out.items():  # each entry's val_prompts after its prompts
        path = tmp_path / f"{name}_val.jsonl"
        path.write_text("\n".join(records) + "\n")
        entry = f'environment = "tests.e2e.test_rl_mixture:{name}"\nprompts = "{PROMPTS}"\n'
        text = text.replace(entry, entry + f'val_prompts = "{path}"\n')
    open(mixture, "w").write(text)
    out = tmp_path / "run"
    extra = ("--max-steps", "2", "--val.interval", "2", "--val.eval-on-start")
    result = run_cli("rl", *config_args(mixture, tiny_model_dir, out, *extra))
    first, last = read_metrics(out)
    for prefix, row in (("val/start/", first), ("val/", last)):
        means = {name: row[f"{prefix}{name}/reward/mean"] for name in held_out}
        assert means["letters"] != means["short"]
        # Overall: every held-out prompt weighs the same (3 of letters', 5 of short's).
        overall = (3 * means["letters"] + 5 * means["short"]) / 8
        assert abs(row[f"{prefix}reward/mean"] - overall) < 1e-12
    assert "val/start/letters " in result.stdout and "val/short " in result.stdout
