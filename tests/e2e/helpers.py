"""Running the real scripts in subprocesses, single-process or under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fnt.store.rundir import METRICS_FILE

REPO = Path(__file__).resolve().parents[2]


def read_metrics(output_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def repo_path() -> str:
    """A child's PYTHONPATH: the repository, then this process's PYTHONPATH, if any."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(REPO), inherited] if inherited else [str(REPO)])


def run_script(
    script: str,
    *args: str,
    nproc: int = 0,
    timeout: float = 300,
    check: bool = True,
    module: bool = False,
    env: dict[str, str] | None = None,
):
    """Run scripts/{script} (or `script` itself when it is an absolute path, such as a test's own
    loop, or the module `script` with `-m` when module=True) with args; under torchrun
    --standalone when nproc > 0. The repository is first on PYTHONPATH so that such loops can
    import the tests' helpers, before what PYTHONPATH had (the GPU check's machine has fnt's
    dependencies there, in its site folder). `env` adds to (or replaces) the child's
    environment."""
    launcher = [*TORCHRUN, "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    target = ["-m", script] if module else [str(REPO / "scripts" / script)]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WANDB_SILENT": "true",
        "PYTHONPATH": repo_path(),
        **(env or {}),
    }
    # A session of its own, so that a hung run's torchrun workers die with it on timeout.
    with subprocess.Popen(
        [*launcher, *target, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            raise AssertionError(
                f"{script} {' '.join(args)} ran past {timeout} s and was killed\n--- stdout\n"
                f"{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
            ) from None
    proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_cli(command: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`fnt COMMAND ARGS` in this process: the command line's whole path (parsing, preflight,
    the driver, the exit status of bad input) without a new interpreter, whose imports cost
    seconds where a tiny run costs a fraction of one. Results are bit-identical to a subprocess
    run's (the run sets its own thread count). Tests that kill, signal, launch ranks or change
    the environment of imports use `run_script` instead.

    Returns what `run_script` returns: the exit status (0, the SystemExit code, or 1 for an
    exception, whose traceback then ends stderr when check is false), stdout and stderr.
    """
    import contextlib
    import io
    import traceback

    from fnt.__main__ import main

    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main([command, *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:
            if check:
                raise
            code = 1
            traceback.print_exc()
    proc = subprocess.CompletedProcess(
        ["fnt", command, *args], code, stdout.getvalue(), stderr.getvalue()
    )
    if check and code != 0:
        raise AssertionError(
            f"fnt {command} {' '.join(args)} exited {code}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_fnt(command: str, *args: str, nproc: int = 0, env: dict[str, str] | None = None):
    """`fnt COMMAND ARGS` (sft or rl): in this process for one rank (`run_cli`), in a subprocess
    under torchrun for nproc > 0 or when the child needs `env` (`run_script`)."""
    if nproc or env:
        return run_script(f"{command}.py", *args, nproc=nproc, env=env)
    return run_cli(command, *args)


def config_args(config: str, model_dir, out, *extra: str) -> tuple[str, ...]:
    """`--config CONFIG --model.name MODEL --output-dir OUT` plus extra arguments."""
    return ("--config", config, "--model.name", str(model_dir), "--output-dir", str(out), *extra)


def model_weights(ckpt_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, converted through a torch.save file in tmp_path."""
    target = tmp_path / f"{ckpt_dir.parent.parent.name}_{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, target)
    return torch.load(target, weights_only=False)["model"]


def copy_crashed_run(full: Path, crashed: Path, step: int) -> None:
    """Make `crashed` look like `full` crashed after its checkpoint at `step`: that checkpoint,
    and the metrics rows written beyond it, which resume must trim."""
    shutil.copytree(full / "checkpoints" / f"step_{step}", crashed / "checkpoints" / f"step_{step}")
    shutil.copy(full / "metrics.jsonl", crashed / "metrics.jsonl")


def assert_resumed_run_matches(
    full: Path, resumed: Path, resumed_at: int, last: int, keys, tmp_path: Path
) -> None:
    """`resumed` (resumed at step `resumed_at`) logged one row per step 1..last, rows after the
    resume equal `full`'s in `keys`, and both final checkpoints hold the same weights."""
    rows_full, rows_resumed = read_metrics(full), read_metrics(resumed)
    assert [r["step"] for r in rows_resumed] == list(range(1, last + 1))
    for a, b in zip(rows_full[resumed_at:], rows_resumed[resumed_at:]):
        for key in keys:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    w_full = model_weights(full / "checkpoints" / f"step_{last}", tmp_path)
    w_resumed = model_weights(resumed / "checkpoints" / f"step_{last}", tmp_path)
    assert w_full.keys() == w_resumed.keys()
    for name in w_full:
        assert torch.equal(w_full[name], w_resumed[name]), name


def run_killed(
    *args: str,
    fault: str,
    nproc: int = 0,
    env: dict[str, str] | None = None,
    script: str = "sft.py",
):
    """Run scripts/{script} with args and FNT_FAULT=`fault` (fnt.faults); assert it was killed."""
    from fnt.faults import FAULT_ENV

    proc = run_script(
        script, *args, nproc=nproc, check=False, env={FAULT_ENV: fault, **(env or {})}
    )
    if nproc:  # torchrun reports its killed worker and stops the others
        assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def write_datasets_cache(
    records: list[dict],
    cache_dir: Path,
    name: str,
    *,
    subset: str = "default",
    split: str = "train",
) -> Path:
    """Put `records` into the `datasets` cache `cache_dir` (what HF_DATASETS_CACHE names) as the
    split of dataset `name` ("namespace/name"), laid out as `load_dataset(name)` leaves a Hub
    parquet dataset there: `{namespace}___{name}/{subset}/0.0.0/{hash}/`, with the Arrow file
    and dataset_info.json written by datasets' own parquet builder. Offline, load_dataset(name,
    subset, split=split) then finds it, as it finds a dataset once loaded with network access.
    Returns that directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, leaf = name.split("/")
    source = cache_dir / "sources" / f"{leaf}-{subset}-{split}.parquet"
    source.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_struct_array(pa.array(records)), source)
    builder = Parquet(
        cache_dir=str(cache_dir),
        dataset_name=leaf,
        config_name=subset,
        config_id=subset,
        hash="0123456789abcdef",  # a Hub load puts the repository's commit here
        data_files={split: [str(source)]},
    )
    builder.download_and_prepare()
    # The builder knows no Hub repository, so it writes under the bare name; a Hub load prefixes
    # the namespace.
    target = cache_dir / f"{namespace}___{leaf}"
    target.mkdir(exist_ok=True)
    shutil.move(cache_dir / leaf / subset, target / subset)
    shutil.rmtree(cache_dir / leaf)
    return target / subset
