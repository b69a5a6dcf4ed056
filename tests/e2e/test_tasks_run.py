"""An RL run on reasoning-gym tasks end to end (fnt rl with rollout.environment = "reasoning_gym"):
rows with each task's reward and held-out val rewards, and an exact resume of the prompt stream."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
)

# spell_backward (3 of 4 prompts) and power_function, whose scorer gives any answer 0.01 and
# none 0: the policy that sometimes stops at once (tests/conftest.py) gets rewards that differ.
TASKS = [{"name": "spell_backward", "weight": 3}, {"name": "power_function"}]


def task_args(model_dir, out, *extra):
    return config_args(
        "examples/debug/rl.toml",
        model_dir,
        out,
        "--max-steps=4",
        "--seq-len=256",
        "--rollout.prompts=",
        "--rollout.environment=reasoning_gym",
        f"--rollout.reasoning_gym.tasks={json.dumps(TASKS)}",
        "--rollout.reasoning_gym.answer=text",
        "--rollout.reasoning_gym.size=40",
        "--rollout.reasoning_gym.val_size=4",
        "--rollout.prompts-per-step=4",
        "--batch-size=16",
        "--val.interval=2",
        "--runtime.num-threads=1",
        *extra,
    )


@pytest.mark.numerics
def test_a_reasoning_gym_run_logs_each_tasks_reward_and_resumes_the_prompt_stream_exactly(
    policy_dir, tmp_path
):
    full = tmp_path / "full"
    run_cli("rl", *task_args(policy_dir, full, "--ckpt.interval=2"))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("reward/spell_backward/mean" in r for r in rows)
    assert any("reward/power_function/mean" in r for r in rows)
    assert any(r["reward/std"] > 0 for r in rows), "no learning signal: the resume checks less"
    for row in rows[1::2]:  # the held-out prompts of both tasks, scored by each task
        assert {"val/reward/spell_backward/mean", "val/reward/power_function/mean"} <= row.keys()

    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *task_args(policy_dir, resumed, "--resume", "latest"))
    # Other prompts would have other lengths: the context tokens show the same prompts came.
    keys = (
        "reward/mean",
        "reward/std",
        "loss/mean",
        "optim/grad_norm",
        "rollout/context_tokens",
        "rollout/sampled_tokens",
        "reward/spell_backward/mean",
    )
    assert_resumed_run_matches(full, resumed, 2, 4, keys, tmp_path)
    assert read_metrics(resumed)[3]["val/reward/mean"] == rows[3]["val/reward/mean"]
