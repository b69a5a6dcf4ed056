"""The seed's helpers as its loops call them: the two drivers in examples/seed_loops/, written
with those helpers, write the rows `fnt sft` and `fnt rl` write on the same config (1 rank, and
2 ranks under torchrun for SFT); and each helper takes the seed's arguments."""

from __future__ import annotations

import pytest
import torch

from fnt import (
    Config,
    ModelConfig,
    init_state,
    log_step_metrics,
    resolve_resume_step,
    save_trace,
    setup_optimizer,
    setup_trainer,
    start_trace,
)
from fnt.config import OptimConfig
from fnt.testing.properties import results
from tests.e2e.helpers import REPO, config_args, read_metrics, run_cli, run_script
from tests.e2e.test_sft_run import two_rank_job as cli_two_rank_job

SFT_LOOP = REPO / "examples" / "seed_loops" / "sft_loop.py"
RL_LOOP = REPO / "examples" / "seed_loops" / "rl_loop.py"


def assert_same_rows(rows, expected):
    assert [sorted(r) for r in rows] == [sorted(r) for r in expected]
    assert results(rows) == results(expected)


@pytest.mark.numerics
def test_the_sft_loop_writes_the_rows_of_fnt_sft(tiny_model_dir, tmp_path):
    args = ("--max-steps", "4")
    run_cli("sft", *config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "cli", *args))
    loop_args = config_args("examples/debug/sft.toml", tiny_model_dir, tmp_path / "loop", *args)
    run_script(str(SFT_LOOP), *loop_args)
    assert_same_rows(read_metrics(tmp_path / "loop"), read_metrics(tmp_path / "cli"))
    assert len(read_metrics(tmp_path / "loop")) == 4


@pytest.mark.numerics
def test_the_rl_loop_writes_the_rows_of_fnt_rl(tiny_model_dir, tmp_path):
    args = ("--max-steps", "3")
    run_cli("rl", *config_args("examples/debug/rl.toml", tiny_model_dir, tmp_path / "cli", *args))
    loop_args = config_args("examples/debug/rl.toml", tiny_model_dir, tmp_path / "loop", *args)
    run_script(str(RL_LOOP), *loop_args)
    rows = read_metrics(tmp_path / "loop")
    assert_same_rows(rows, read_metrics(tmp_path / "cli"))
    assert len(rows) == 3 and "reward/mean" in rows[0]


def loop_two_rank_job(fixture, out):
    """The SFT loop at two ranks on the arguments of test_sft_run's two-rank `fnt sft` job."""
    spec = cli_two_rank_job(fixture, out)
    return {"call": "examples.seed_loops.sft_loop:main", "args": [spec["args"][0][1:]]}


@pytest.mark.numerics
@pytest.mark.two_ranks(job=cli_two_rank_job)
@pytest.mark.two_ranks(job=loop_two_rank_job)
def test_the_sft_loop_at_two_ranks_writes_the_rows_of_fnt_sft(two_rank_runs):
    cli = read_metrics(two_rank_runs(cli_two_rank_job) / "run")
    loop = read_metrics(two_rank_runs(loop_two_rank_job) / "run")
    assert_same_rows(loop, cli)
    assert (two_rank_runs(loop_two_rank_job) / "run" / "trace" / "trace_1.json.gz").is_file()


def test_each_helper_takes_the_seeds_arguments(tiny_model_dir, tmp_path):
    config = Config(model=ModelConfig(name=str(tiny_model_dir)), output_dir=str(tmp_path))
    runtime = setup_trainer(config, seq_len=32)  # setup_trainer(config, seq_len=None)
    assert resolve_resume_step("latest", tmp_path / "checkpoints") is None
    prof = start_trace(str(tmp_path / "trace"))
    state = init_state(config, runtime)
    optimizer = setup_optimizer(config.optim, state.handles.model, runtime.dims, config.model)
    assert isinstance(optimizer, torch.optim.AdamW)
    metrics = {"loss/mean": torch.tensor(2.5), "optim/lr": 1e-3}
    row = log_step_metrics(
        1, metrics, runtime=runtime, step_time=0.5, num_tokens=100, ckpt_dir=tmp_path
    )
    assert row["step"] == 1 and row["loss/mean"] == 2.5 and row["perf/throughput"] == 200.0
    assert {"system/ckpt_disk_free_gib", "time/step", "perf/mfu"} <= set(row)
    assert save_trace(prof, str(tmp_path / "trace")) == tmp_path / "trace" / "trace_0.json.gz"


def test_setup_optimizer_with_the_seeds_arguments_carries_out_full_offload(tiny_model_dir):
    """In one process, full offload's cast to optim.offload_dtype (float32 masters in the CPU
    AdamW) is the optimizer's part of the offload plan."""
    optim = OptimConfig(impl="reference", offload="full", offload_dtype="bfloat16")
    config = Config(model=ModelConfig(name=str(tiny_model_dir)), optim=optim)
    runtime = setup_trainer(config)
    model = init_state(Config(model=config.model), runtime).handles.model
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = setup_optimizer(config.optim, model, runtime.dims, config.model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    masters = [optimizer.state[p]["master"] for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m, weights[n]) for m, (n, _) in zip(masters, model.named_parameters()))
