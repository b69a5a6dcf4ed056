"""rollout.async_level: the rollouts of update n come from the policy after step n - 1 - k,
generated in the background, and a resumed run samples exactly what an uninterrupted one does."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from fnt.distributed.runtime import setup_trainer
from fnt.loop import fold
from fnt.rollout.base import rollout_policy_step
from fnt.rollout.engines.in_process import InProcessEngine
from fnt.sources import rl_source
from fnt.store.rundir import COMPONENTS_DIR
from steps import rl_step
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
    run_fnt,
)

from . import counting_reward
from .conftest import rl_config, rl_state
from .test_engine import assert_same_batch

STEPS = 4


def test_rollout_policy_steps():
    assert [rollout_policy_step(n, 0) for n in range(1, 5)] == [0, 1, 2, 3]
    assert [rollout_policy_step(n, 1) for n in range(1, 5)] == [0, 0, 1, 2]
    assert [rollout_policy_step(n, 2) for n in range(1, 6)] == [0, 0, 0, 1, 2]


def test_async_rollouts_are_the_on_policy_samples_of_the_policy_k_steps_older(
    policy_dir, prompts_file, tmp_path
):
    on_policy = rl_config(policy_dir, prompts_file)
    # The ratio loss: on-policy, the default loss's Δp masks nothing and its penalty is ~0, so an
    # update can round to no change in float32; the ratio loss moves every step's weights.
    # Seed 0: step 1 has rewards to learn from, so the policies after steps 0 and 1 differ.
    on_policy = dataclasses.replace(
        on_policy,
        seed=0,
        output_dir=str(tmp_path),
        loss=dataclasses.replace(on_policy.loss, kind="ratio"),
    )
    config = dataclasses.replace(
        on_policy, rollout=dataclasses.replace(on_policy.rollout, async_level=1)
    )
    state = rl_state(config)
    engine = state.handles.rollouts
    batches, weights = [], [clone_weights(state.handles.model)]
    states = []

    def recording_source(state):
        states.append(state.progress)
        batch = rl_source(state)
        batches.append(batch)
        return batch

    skipped = []
    for state, metrics in fold(state, recording_source, rl_step, 3):
        weights.append(clone_weights(state.handles.model))
        skipped.append(bool(metrics.get("skipped/zero_advantage", 0)))
    # A checkpoint after step 3 holds the policy after step 2 (update 4's rollouts come from
    # it; the one after step 3 is the model), and the engine writes nothing of its own
    # besides the saved samples (fnt.store.samples).
    assert list(engine.state_dict()["policies"]) == [2]
    assert [p.name for p in tmp_path.iterdir() if p.name != "samples"] == []
    engine.close()
    # Each update moved the weights (unless it had no advantage to learn from), so the policies
    # the rollouts are compared with below are told apart.
    sums = [tuple(float(t.sum()) for t in w.values()) for w in weights]
    for n, was_skipped in enumerate(skipped, start=1):
        assert (sums[n] == sums[n - 1]) == was_skipped, n
    assert sums[1] != sums[0]

    reference = InProcessEngine(on_policy, setup_trainer(on_policy))
    for n, (batch, progress) in enumerate(zip(batches, states), start=1):
        policy_step = rollout_policy_step(n, 1)
        reference.model.load_state_dict(weights[policy_step])
        samples, dropped, after = reference.sample(reference.model, n, progress.data, policy_step)
        expected = reference.batch(
            samples, after, 0.0, step=n, staleness=n - 1 - policy_step, dropped=dropped
        )
        assert_same_batch(batch, expected)
        assert batch.metrics["rollout/staleness"] == min(n - 1, 1)


def clone_weights(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


EXACT = ("reward/mean", "reward/std", "loss/mean", "optim/grad_norm", "rollout/staleness")


@pytest.mark.parametrize(
    "nproc", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
@pytest.mark.numerics
def test_async_level_1_resumes_exactly(tiny_model_dir, tmp_path, nproc):
    def args(out, *extra):
        return config_args(
            "examples/debug/rl.toml",
            tiny_model_dir,
            out,
            "--max-steps",
            str(STEPS),
            "--rollout.async_level",
            "1",
            "--runtime.num-threads",
            "1",
            *extra,
        )

    def rl(*extra):
        run_fnt("rl", *args(*extra), nproc=nproc)

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rl(full, "--ckpt.interval", "2")
    rows = read_metrics(full)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # The resumed run's next rollouts (update 3) come from the policy after step 1, which
    # checkpoint step_2 holds: a crash right after it leaves all a resume needs.
    assert (full / "checkpoints" / "step_2" / COMPONENTS_DIR / "rollouts.pt").is_file()
    copy_crashed_run(full, resumed, 2)
    rl(resumed, "--resume", "latest")
    assert_resumed_run_matches(full, resumed, 2, STEPS, EXACT, tmp_path)
    for run in (full, resumed):
        assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoints", "samples"]


def test_an_async_run_generates_exactly_the_rollouts_it_trains_on(
    tiny_model_dir, tmp_path, monkeypatch
):
    """async_level 3 and 2 steps: the queue never reaches past max_steps, and the run leaves no
    generation behind when it returns."""
    monkeypatch.setattr(counting_reward, "calls", [])
    args = config_args("examples/debug/rl.toml", tiny_model_dir, tmp_path / "run")
    args += ("--max-steps", "2", "--rollout.async-level", "3")
    args += ("--rollout.reward", "tests.fnt.rollout.counting_reward:reward")
    run_cli("rl", *args)
    per_step = 2 * 4  # prompts_per_step x group_size of examples/debug/rl.toml
    # One call more: the start-up trial scores the first prompt's answer before the model loads.
    trial = 1
    assert len(counting_reward.calls) == trial + 2 * per_step
    assert not [t for t in threading.enumerate() if t.name.startswith("fnt-rollout")]
    time.sleep(0.5)
    assert len(counting_reward.calls) == trial + 2 * per_step


@pytest.mark.numerics
def test_evaluation_during_an_async_run_changes_no_rollout(tiny_model_dir, tmp_path):
    """Greedy val answers come from the engine's inference copy; the background jobs sample on
    a copy of their own, so evaluating after every step leaves every training row as it is."""

    def rows(out, *extra):
        args = config_args("examples/debug/rl.toml", tiny_model_dir, out, *extra)
        args += ("--max-steps", "4", "--rollout.async-level", "2", "--runtime.num-threads", "1")
        run_cli("rl", *args, "--rollout.max-new-tokens", "24")
        return read_metrics(out)

    plain = rows(tmp_path / "plain")
    evaluated = rows(
        tmp_path / "evaluated",
        *("--val.prompts", "examples/debug/prompts.jsonl", "--val.interval", "1"),
    )
    assert all("val/reward/mean" in row for row in evaluated)
    for a, b in zip(plain, evaluated, strict=True):
        for key in ("reward/mean", "reward/std", "loss/mean", "optim/grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
