"""Two nodes simulated on this host: two torchrun launchers (--nnodes 2, one process each) meet at
a c10d rendezvous on 127.0.0.1 and train with parallel.dp_replicate = 2 (HSDP: replicated across
the nodes, sharded within each). Losses equal one process with the same global batch, and a
checkpoint + resume across that layout is exact."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.e2e.helpers import (
    REPO,
    assert_resumed_run_matches,
    config_args,
    copy_crashed_run,
    read_metrics,
    run_cli,
)

pytestmark = pytest.mark.numerics

N, K = 4, 2
HSDP = ("--parallel.dp-replicate", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(*args: str, timeout: float = 240) -> None:
    """scripts/sft.py ARGS on two simulated nodes; fails with both launchers' output."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            + ["--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
            + ["--rdzv-endpoint", endpoint, "--rdzv-id", "fnt-two-nodes"]
            + [str(REPO / "scripts" / "sft.py"), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=timeout)[0])
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    codes = [launcher.returncode for launcher in launchers]
    assert codes == [0, 0], "\n".join(
        f"--- node {i}\n{out[-4000:]}" for i, out in enumerate(outputs)
    )


def sft_args(model_dir, out, *extra):
    return config_args("examples/debug/sft.toml", model_dir, out, "--max-steps", str(N), *extra)


@pytest.fixture(scope="module")
def two_node_run(tiny_model_dir, tmp_path_factory):
    nodes = tmp_path_factory.mktemp("two_nodes") / "nodes"
    run_two_nodes(*sft_args(tiny_model_dir, nodes, "--ckpt.interval", str(K), *HSDP))
    return nodes


def test_two_nodes_with_hsdp_equal_one_process(tiny_model_dir, tmp_path, two_node_run):
    single = tmp_path / "single"
    run_cli("sft", *sft_args(tiny_model_dir, single))
    for one, two in zip(read_metrics(single), read_metrics(two_node_run), strict=True):
        assert one["loss/mean"] == pytest.approx(two["loss/mean"], abs=1e-5)
        assert one["optim/grad_norm"] == pytest.approx(two["optim/grad_norm"], rel=1e-4)


@pytest.mark.slow  # exact 2-rank resume is in the default suite too (tests/e2e/test_tied.py)
def test_a_resume_across_two_nodes_is_exact(tiny_model_dir, tmp_path, two_node_run):
    resumed = tmp_path / "resumed"
    copy_crashed_run(two_node_run, resumed, K)
    run_two_nodes(*sft_args(tiny_model_dir, resumed, "--resume", "latest", *HSDP))
    keys = ("loss/mean", "optim/grad_norm")
    assert_resumed_run_matches(two_node_run, resumed, K, N, keys, tmp_path)
