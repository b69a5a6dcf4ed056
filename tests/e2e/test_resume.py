"""Resume is exact and checkpoints are transactions: real runs, real crashes."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fnt import Config, ConfigError, ModelConfig, fold, init_state, sft_source
from fnt.build import save_state_
from fnt.config import OptimConfig
from fnt.distributed.runtime import setup_trainer
from fnt.resume import resolve_resume_step
from fnt.start import start_state
from fnt.store.rundir import ABANDONED_DIR
from fnt.store.transaction import COMPLETE_MARKER
from steps import sft_step
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
    run_fnt,
    run_killed,
)

pytestmark = pytest.mark.numerics

N, K = 6, 3
EXACT_KEYS = (
    "loss/mean",
    "optim/grad_norm",
    "optim/lr",
    "progress/num_samples",
    "progress/num_tokens",
)


def args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


@pytest.mark.parametrize(
    "nproc", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["1rank", "2ranks"]
)
def test_k_steps_then_resume_equals_n_steps(tiny_model_dir, tmp_path, nproc):
    def sft(*extra):
        run_fnt("sft", *args(tiny_model_dir, *extra), nproc=nproc)

    full = tmp_path / "full"
    sft(full, "--ckpt.interval", str(K))
    # A crashed run: its checkpoint at K, and metrics rows it had written beyond K.
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, K)
    sft(resumed, "--resume", "latest")
    assert_resumed_run_matches(full, resumed, K, N, EXACT_KEYS, tmp_path)


@pytest.mark.parametrize("phase", ["shards", pytest.param("marker", marks=pytest.mark.slow)])
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(
    tiny_model_dir, tmp_path, phase
):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out, "--ckpt.interval", "2"), fault=f"{phase}@4")
    assert (out / "checkpoints" / "step_4.partial").is_dir()  # the save really was under way
    assert resolve_resume_step("latest", out / "checkpoints") == 2

    run_cli("sft", *args(tiny_model_dir, out, "--ckpt.interval", "2", "--resume", "latest"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    assert resolve_resume_step("latest", out / "checkpoints") == N
    assert not (out / "checkpoints" / "step_4.partial").exists()


KEEP_ONE = ("--ckpt.interval", "2", "--ckpt.keep-last", "1")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_cli("sft", *args(tiny_model_dir, out, *KEEP_ONE))
    return out


@pytest.mark.parametrize(
    "fault",
    # Right after step_4's rename; and while the cleanup after that save deletes step_2.
    # committed@4 is slow for the default suite's time (cleanup@2 kills after a commit too).
    [pytest.param("committed@4", marks=pytest.mark.slow), "cleanup@2"],
)
def test_sigkill_after_a_commit_keeps_every_row_exactly_once(
    tiny_model_dir, tmp_path, uninterrupted, fault
):
    out = tmp_path / "run"
    run_killed(*args(tiny_model_dir, out, *KEEP_ONE), fault=fault)
    # step_4 is complete, so its row must be there already: nothing would ever write it again.
    assert resolve_resume_step("latest", out / "checkpoints") == 4
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]

    run_cli("sft", *args(tiny_model_dir, out, *KEEP_ONE, "--resume", "latest"))
    # The interrupted delete of step_2 was finished: only the kept checkpoint is left.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{N}"]
    assert_resumed_run_matches(uninterrupted, out, 4, N, EXACT_KEYS, tmp_path)


def test_resume_from_an_older_step_forks_and_keeps_the_old_trajectory_aside(
    tiny_model_dir, tmp_path
):
    full = tmp_path / "full"
    run_cli("sft", *args(tiny_model_dir, full, "--ckpt.interval", "2"))

    # The same directory resumed at step 2: newer checkpoints and an unfinished save are there.
    forked = tmp_path / "forked"
    shutil.copytree(full, forked)
    (forked / "checkpoints" / "step_5.partial").mkdir()
    proc = run_cli(
        "sft",
        *args(tiny_model_dir, forked, "--ckpt.interval", "2", "--ckpt.keep-last", "2"),
        "--resume",
        "2",
    )
    stale = ["step_4", "step_5.partial", "step_6"]
    (fork,) = (forked / "checkpoints" / ABANDONED_DIR).iterdir()
    assert sorted(p.name for p in fork.iterdir()) == stale
    for name in stale:
        assert proc.stdout.count(f"checkpoints/{name} to ") == 1, proc.stdout
    # keep_last counted only the new trajectory: its own step_4 and step_6 are kept.
    assert sorted(p.name for p in (forked / "checkpoints").iterdir()) == [
        ABANDONED_DIR,
        "step_4",
        "step_6",
    ]
    assert resolve_resume_step("latest", forked / "checkpoints") == N
    assert_resumed_run_matches(full, forked, 2, N, EXACT_KEYS, tmp_path)


def test_a_save_is_timed_in_the_next_row(uninterrupted):
    """Row N is written before step N's save, so that save's time goes into row N + 1."""
    saves = {r["step"]: r["time/save_ckpt"] for r in read_metrics(uninterrupted)}
    assert [step for step, seconds in saves.items() if seconds > 0] == [3, 5]


# Reconciling the config with the checkpoint's; files of an earlier run --------------------


def saved_optimizer_groups(ckpt_dir, tmp_path):
    """The hyperparameters of the optimizer's param groups as a checkpoint holds them."""
    target = tmp_path / f"optim_{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, target)
    groups = torch.load(target, weights_only=False)["optim"]["param_groups"]
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def test_a_resume_refuses_a_changed_seed_and_uses_a_changed_weight_decay(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_cli("sft", *args(tiny_model_dir, out, "--max-steps", "1"))
    ckpt = out / "checkpoints"
    assert json.loads((ckpt / "step_1" / "config.json").read_text())["seed"] == 0

    changed = (
        "--max-steps",
        "2",
        "--resume",
        "latest",
        "--seed",
        "1",
        "--optim.weight-decay",
        "0.5",
    )
    refused = run_cli("sft", *args(tiny_model_dir, out, *changed), check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("error: resume from ") and "seed: 0 -> 1" in error
    assert "weight_decay" not in error and "--resume.force" in error
    assert [r["step"] for r in read_metrics(out)] == [1]  # nothing ran

    forced = run_cli("sft", *args(tiny_model_dir, out, *changed, "--resume.force"))
    assert "resume: seed: 0 -> 1 (a fixed key, forced by --resume.force)" in forced.stdout
    assert "resume: optim.weight_decay: 0.0 -> 0.5" in forced.stdout
    assert "resume: max_steps: 1 -> 2" in forced.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    # Step 2 ran with the new weight decay, not the one loading step_1's optimizer restored.
    assert [g["weight_decay"] for g in saved_optimizer_groups(ckpt / "step_1", tmp_path)] == [0.0]
    assert [g["weight_decay"] for g in saved_optimizer_groups(ckpt / "step_2", tmp_path)] == [0.5]
    recorded = json.loads((ckpt / "step_2" / "config.json").read_text())
    assert (recorded["seed"], recorded["optim"]["weight_decay"]) == (1, 0.5)


def in_process_config(model_dir, out, **overrides) -> Config:
    return Config(
        model=ModelConfig(name=str(model_dir)),
        output_dir=str(out),
        seq_len=32,
        batch_size=4,
        micro_batch_size=2,
        **overrides,
    )


def saved_run(model_dir, out, steps: int, **overrides) -> Config:
    """An output_dir holding checkpoints step_1..step_{steps} of an in-process run."""
    config = in_process_config(model_dir, out, **overrides)
    state = init_state(config, setup_trainer(config))
    for state, _ in fold(state, sft_source, sft_step, steps):
        save_state_(state)
    return config


def test_restored_optimizer_takes_the_current_hyperparameters(tiny_model_dir, tmp_path):
    saved_run(tiny_model_dir, tmp_path, 1)
    optim = OptimConfig(lr=2e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.25)
    config = in_process_config(tiny_model_dir, tmp_path, resume=1, optim=optim)
    state = start_state(config, setup_trainer(config))
    (group,) = state.handles.optimizer.param_groups
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        2e-3,
        (0.8, 0.95),
        1e-6,
        0.25,
    )


def make_step_dirs(root, steps, marker=True):
    for step in steps:
        (root / f"step_{step}").mkdir(parents=True)
        if marker:
            (root / f"step_{step}" / COMPLETE_MARKER).write_text("")


def test_a_fork_moves_newer_published_weights_aside(tiny_model_dir, tmp_path, capsys):
    """Stale weights/step_3.. would count as the newest for keep_weights (deleting what the
    resumed run publishes) and an orchestrator could load them."""
    saved_run(tiny_model_dir, tmp_path, 2)
    weights = tmp_path / "weights"
    make_step_dirs(weights, [0, 1, 2, 3, 4])
    (weights / "step_5.partial").mkdir()
    config = in_process_config(tiny_model_dir, tmp_path, resume=2)
    assert start_state(config, setup_trainer(config)).progress.step == 2
    assert sorted(p.name for p in weights.iterdir()) == [
        ABANDONED_DIR,
        "step_0",
        "step_1",
        "step_2",
    ]
    (fork,) = (weights / ABANDONED_DIR).iterdir()
    assert sorted(p.name for p in fork.iterdir()) == ["step_3", "step_4", "step_5.partial"]
    assert capsys.readouterr().out.count("weights/step_") == 3


@pytest.mark.parametrize("stale", ["rollouts/step_1", "weights/step_0", "rollouts/step_2.partial"])
def test_a_fresh_start_refuses_an_earlier_rl_runs_files(tiny_model_dir, tmp_path, stale):
    (tmp_path / stale).mkdir(parents=True)
    config = in_process_config(tiny_model_dir, tmp_path)
    with pytest.raises(
        ConfigError, match=re.escape(f"fresh start, but {tmp_path / stale.split('/')[0]}")
    ):
        start_state(config, setup_trainer(config))
    shutil.rmtree(tmp_path / stale.split("/")[0])
    assert start_state(config, setup_trainer(config)).progress.step == 0
