"""scripts/rl.py end to end with the in-process engine: rows, keys, exact resume (after a copied
crash, and after a real SIGKILL of a multi-turn run); with LoRA."""

from __future__ import annotations

import pytest

from fnt.model.lora import is_adapter_weight
from tests.e2e.helpers import (
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    model_weights,
    read_metrics,
    run_cli,
    run_fnt,
    run_killed,
)

RL_KEYS = {
    "loss/mean",
    "entropy/all/mean",
    "mismatch_kl/all/mean",
    "kl_ent_ratio/mean",
    "masked/high_fraction",
    "masked/low_fraction",
    "reward/mean",
    "reward/std",
    "time/rollout",
    "rollout/tokens_per_second",
    "optim/grad_norm",
    "optim/lr",
    "perf/throughput",
    "perf/mfu",
    "system/ckpt_disk_free_gib",
    "time/step",
    "time/save_ckpt",
    "progress/num_samples",
}
EXACT = ("reward/mean", "reward/std", "loss/mean", "optim/grad_norm", "entropy/all/mean")


def rl_args(model_dir, out, *extra):
    return config_args("examples/debug/rl.toml", model_dir, out, "--max-steps", "4", *extra)


@pytest.mark.numerics
def test_debug_rl_writes_rows_with_the_rl_keys_and_resumes_exactly(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    run_cli("rl", *rl_args(tiny_model_dir, full, "--ckpt.interval", "2"))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert RL_KEYS <= row.keys(), RL_KEYS - row.keys()
    assert any(r["reward/std"] > 0 for r in rows)  # a real learning signal, not all-zero advantages
    assert any(r["optim/grad_norm"] > 0 for r in rows)

    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *rl_args(tiny_model_dir, resumed, "--resume", "latest"))
    assert_resumed_run_matches(full, resumed, 2, 4, EXACT, tmp_path)


@pytest.mark.numerics
@pytest.mark.parametrize("async_level", [0, 1])
def test_lora_rl_with_reference_kl_generates_from_the_adapters_and_resumes_exactly(
    tiny_model_dir, tmp_path, async_level
):
    lora = ("--model.lora.rank", "4", "--loss.ref-kl-tau", "0.1", "--optim.lr", "0.05")
    extra = (*lora, "--rollout.async-level", str(async_level))
    full = tmp_path / "full"
    run_cli("rl", *rl_args(tiny_model_dir, full, "--ckpt.interval", "2", *extra))
    rows = read_metrics(full)
    # The reference is the base: the policy is the base at step 1, and moves away from it.
    assert rows[0]["ref_kl/mean"] == 0.0
    assert all(r["ref_kl/mean"] > 0 for r in rows[1 + async_level :])
    assert all(
        is_adapter_weight(n) for n in model_weights(full / "checkpoints" / "step_4", tmp_path)
    )

    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *rl_args(tiny_model_dir, resumed, "--resume", "latest", *extra))
    assert_resumed_run_matches(full, resumed, 2, 4, (*EXACT, "ref_kl/mean"), tmp_path)


MULTI_TURN = (
    "--rollout.environment",
    "tests.fnt.rollout.multi_turn_env:feedback",
    "--rollout.max-turns",
    "3",
    "--batch-size",
    "8",  # a row per episode: episodes are up to seq_len long
    "--runtime.num-threads",
    "1",
)


# (ranks, async_level, the fault): SIGKILL after step 3's update (resumed from step_2), also on
# rank 1 only, and inside the final save's shard writes (resumed from step_2 too).
KILLS = [
    pytest.param(0, 1, "step@3", id="1rank-async1-after-the-update"),
    pytest.param(0, 0, "row@3", id="1rank-async0-after-the-row", marks=pytest.mark.slow),
    pytest.param(2, 0, "shards@4:1", id="2ranks-async0-rank1-shards", marks=pytest.mark.slow),
    pytest.param(
        2, 1, "step@3:1", id="2ranks-async1-rank1-after-the-update", marks=pytest.mark.slow
    ),
]


@pytest.mark.numerics
@pytest.mark.parametrize("nproc, async_level, fault", KILLS)
def test_a_multi_turn_run_killed_with_sigkill_resumes_exactly(
    policy_dir, tmp_path, nproc, async_level, fault
):
    """The feedback environment (hints and retries) with the in-process engine and the policy
    that stops (tests/conftest.py): episodes of several turns; a run SIGKILLed at a fault point
    (fnt.faults) and resumed == the uninterrupted run, row for row and weight for weight, at
    one and two ranks and with async_level = 1."""
    extra = (*MULTI_TURN, "--rollout.async-level", str(async_level), "--ckpt.interval", "2")
    full = tmp_path / "full"
    run_fnt("rl", *rl_args(policy_dir, full, *extra), nproc=nproc)
    rows = read_metrics(full)
    assert any(r["rollout/turns/mean"] > 1 for r in rows)
    assert all(r["rollout/context_tokens"] > 0 for r in rows)
    assert all("reward/final/mean" in r and "reward/first/mean" in r for r in rows)

    killed = tmp_path / "killed"
    run_killed(*rl_args(policy_dir, killed, *extra), fault=fault, nproc=nproc, script="rl.py")
    assert (killed / "checkpoints" / "step_2").is_dir()
    assert not (killed / "checkpoints" / "step_4").is_dir()
    run_fnt("rl", *rl_args(policy_dir, killed, "--resume", "latest", *extra), nproc=nproc)
    keys = (*EXACT, "rollout/turns/mean", "rollout/sampled_tokens", "reward/final/mean")
    assert_resumed_run_matches(full, killed, 0, 4, keys, tmp_path)


VERIFIERS = (
    "--rollout.prompts",
    "",
    "--rollout.reward",
    "",
    "--rollout.max-turns",
    "2",
    "--batch-size",
    "8",
    "--seq-len",
    "256",
    "--runtime.num-threads",
    "1",
)


@pytest.mark.verifiers
@pytest.mark.numerics
@pytest.mark.parametrize(
    "taskset, rewards",
    [("vf_single", ("exact", "letters")), ("vf_tools", ("correct", "used_tool", "digits"))],
)
def test_a_verifiers_taskset_trains_and_resumes_exactly(policy_dir, tmp_path, taskset, rewards):
    """`fnt rl` with rollout.environment = "verifiers:..." (tasksets in verifiers' style,
    tests/fnt/rollout/vf_single.py and vf_tools.py) and the in-process engine: its tasks are the
    prompts, its rewards are logged by name, the policy updates, and a resumed run equals the
    uninterrupted one."""
    extra = (*VERIFIERS, "--rollout.environment", f"verifiers:tests.fnt.rollout.{taskset}")
    full = tmp_path / "full"
    run_cli("rl", *rl_args(policy_dir, full, *extra, "--ckpt.interval", "2"))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    named = {f"reward/{name}/mean" for name in rewards}
    assert all(named <= row.keys() for row in rows)
    assert any((r["optim/grad_norm"] or 0) > 0 for r in rows)
    resumed = tmp_path / "resumed"
    copy_crashed_run(full, resumed, 2)
    run_cli("rl", *rl_args(policy_dir, resumed, *extra, "--resume", "latest"))
    keys = (*EXACT, "rollout/sampled_tokens", *sorted(named))
    assert_resumed_run_matches(full, resumed, 2, 4, keys, tmp_path)


FILTER = (
    "--rollout.filter-groups",
    "true",
    "--rollout.reward",
    "tests.fnt.rollout.flat_reward:even_counts",  # flat for the prompts ending in an even number
    "--ckpt.interval",
    "2",
)
FILTER_KEYS = (
    "rollout/filter_rounds",
    "rollout/filtered_groups",
    "rollout/filter_exhausted_groups",
)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "nproc", [pytest.param(0, id="1rank"), pytest.param(2, id="2ranks", marks=pytest.mark.slow)]
)
def test_a_filtering_run_killed_with_sigkill_resumes_exactly(tiny_model_dir, tmp_path, nproc):
    """rollout.filter_groups on the debug config with a reward that is flat for half the prompts:
    every row counts its filtered groups and rounds, flat groups were replaced, and a run
    SIGKILLed after step 3's update and resumed from step_2 == the uninterrupted run (the
    prompt position a step leaves is where the next one draws). Two ranks draw and filter the
    same prompts as one."""
    full = tmp_path / "full"
    run_fnt("rl", *rl_args(tiny_model_dir, full, *FILTER), nproc=nproc)
    rows = read_metrics(full)
    assert all(set(FILTER_KEYS) <= row.keys() for row in rows)
    assert sum(r["rollout/filtered_groups"] for r in rows) > 0
    assert any(r["rollout/filter_rounds"] > 1 for r in rows)
    if nproc:
        one_rank = tmp_path / "one_rank"
        run_fnt("rl", *rl_args(tiny_model_dir, one_rank, *FILTER))
        for a, b in zip(read_metrics(one_rank), rows, strict=True):
            assert [a[k] for k in FILTER_KEYS] == [b[k] for k in FILTER_KEYS]

    killed = tmp_path / "killed"
    run_killed(
        *rl_args(tiny_model_dir, killed, *FILTER), fault="step@3", nproc=nproc, script="rl.py"
    )
    assert not (killed / "checkpoints" / "step_4").is_dir()
    run_fnt("rl", *rl_args(tiny_model_dir, killed, "--resume", "latest", *FILTER), nproc=nproc)
    keys = (*EXACT, "rollout/sampled_tokens", *FILTER_KEYS)
    assert_resumed_run_matches(full, killed, 0, 4, keys, tmp_path)
