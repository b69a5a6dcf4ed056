"""Running the real scripts in subprocesses, single-process or under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_script(script: str, *args: str, nproc: int = 0, timeout: float = 300, check: bool = True):
    """Run scripts/{script} with args; under torchrun --standalone when nproc > 0."""
    launcher = [*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [*launcher, str(REPO / "scripts" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def config_args(config: str, model_dir, out, *extra: str) -> tuple[str, ...]:
    """`--config CONFIG --model.name MODEL --output-dir OUT` plus extra arguments."""
    return ("--config", config, "--model.name", str(model_dir), "--output-dir", str(out), *extra)
