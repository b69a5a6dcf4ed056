"""`fnt vllm-serve --config RL.toml`: start a vLLM server for an RL run's vLLM engine.
Side effects: replaces this process with `vllm serve` (or, with --print, prints its command).

vLLM lives in a virtualenv of its own (`make vllm-env`: its pins of torch and transformers are
not fnt's), so this finds its `vllm` program (--vllm, else $FNT_VLLM, else .venv-vllm/bin/vllm
when it exists, else `vllm` on PATH) and runs it with the settings the engine relies on:
- the run's model (model.name) and dtype, served at the host and port of rollout.vllm.urls[i];
- --logprobs-mode processed_logprobs: the logprobs of the distribution it samples from (after
  temperature, over the nucleus of rollout.vllm.top_p), which the loss's importance ratio
  compares with the trainer's, computed over the same nucleus (fnt.model.lm_head);
- --generation-config vllm: no sampling defaults from the model's generation_config.json, so
  the run's rollout settings are the only ones;
- --max-model-len seq_len and the run's seed;
- with rollout.vllm.weight_transfer = "nccl", --weight-transfer-config {"backend": "nccl"};
- VLLM_SERVER_DEV_MODE=1, for the endpoints that reload weights (/collective_rpc,
  /update_weight_version); on a CPU, VLLM_CPU_KVCACHE_SPACE from rollout.vllm.kv_cache_gb.
Arguments after `--` go to `vllm serve` as they are.

`local_server` starts one on 127.0.0.1 for the demo, the benchmark and the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from fnt.apps.cli import parse_config
from fnt.apps.preflight import require_model_dir, require_tokenizer_files
from fnt.config import ConfigError, RLConfig
from fnt.config.engines import check_vllm

LOCAL_VLLM = Path(".venv-vllm/bin/vllm")


def find_vllm(given: Optional[str]) -> str:
    """The vllm program to run (see the module doc); ConfigError when there is none, or when
    the one --vllm or $FNT_VLLM names is not an executable file (exec would fail with a
    traceback)."""
    named_by = [("--vllm", given), ("FNT_VLLM", os.environ.get("FNT_VLLM"))]
    for key, candidate in named_by:
        if candidate:
            program = shutil.which(candidate)
            if program is None:
                where = f"--vllm {candidate!r}" if key == "--vllm" else f"${key} = {candidate!r}"
                raise ConfigError(f"{where}: not an executable program (no such file, or not +x)")
            return program
    candidates = [str(LOCAL_VLLM)] if LOCAL_VLLM.is_file() else []
    candidates.append(shutil.which("vllm"))
    for candidate in candidates:
        if candidate:
            return candidate
    raise ConfigError(
        "no vllm program: pass --vllm PATH or set FNT_VLLM (`make vllm-env` builds "
        ".venv-vllm, with vLLM's CPU build)"
    )


def serve_command(
    config: RLConfig, vllm: str, *, index: int = 0, extra: tuple[str, ...] = (), cuda: bool
) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment variables it adds, for the server of
    rollout.vllm.urls[index]. Pure."""
    settings = config.rollout.vllm
    if not 0 <= index < len(settings.urls):
        raise ConfigError(f"--index {index}: rollout.vllm.urls has {len(settings.urls)} server(s)")
    url = urlparse(settings.urls[index])
    if url.port is None:
        raise ConfigError(f"'rollout.vllm.urls' = {settings.urls[index]!r}: name the port")
    command = [
        vllm,
        "serve",
        config.model.name,
        "--host",
        url.hostname or "127.0.0.1",
        "--port",
        str(url.port),
        "--dtype",
        config.model.dtype,
        "--max-model-len",
        str(config.seq_len),
        "--seed",
        str(config.seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        str(settings.gpu_memory_utilization),
    ]
    if settings.model:
        command += ["--served-model-name", settings.model]
    if settings.weight_transfer == "nccl":
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if settings.kv_cache_gb:
        if cuda:
            command += ["--kv-cache-memory-bytes", str(int(settings.kv_cache_gb * 2**30))]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.kv_cache_gb:g}"
    return command + list(extra), env


def has_cuda() -> bool:
    """Whether this machine has an NVIDIA GPU (without importing torch)."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def main(argv: list[str]) -> None:
    extra: tuple[str, ...] = ()
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], tuple(argv[cut + 1 :])
    parser = argparse.ArgumentParser(
        prog="fnt vllm-serve",
        description='Start the vLLM server an RL run with rollout.engine = "vllm" talks to. '
        "Config keys as for fnt rl (--config FILE.toml, --key=value); arguments after -- go "
        "to vllm serve.",
    )
    parser.add_argument("--vllm", help="the vllm program (default: $FNT_VLLM, .venv-vllm)")
    parser.add_argument(
        "--index", type=int, default=0, help="serve rollout.vllm.urls[INDEX] (default 0)"
    )
    parser.add_argument("--print", action="store_true", help="print the command, run nothing")
    args, config_args = parser.parse_known_args(argv)
    config, model_name_source = parse_config(config_args, RLConfig)
    check_vllm(config.rollout)
    # vLLM reads the model and its tokenizer; a missing one would fail only after its start-up.
    require_model_dir(config.model.name, model_name_source)
    require_tokenizer_files(config.model.name, "vLLM")
    command, env = serve_command(
        config, find_vllm(args.vllm), index=args.index, extra=extra, cuda=has_cuda()
    )
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), *command])
    if args.print:
        print(shown)
        return
    print(f"fnt vllm-serve: {shown}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """A running server `local_server` started: its URL, and stop() to kill it."""

    def __init__(self, url: str, process: subprocess.Popen) -> None:
        self.url, self.process = url, process

    def stop(self) -> None:
        """Kill its process group (vllm serve and its engine processes) and wait for it."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended in between
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def local_server(
    config_args: Sequence[str],
    log: Path,
    *,
    vllm: Optional[str] = None,
    extra: Sequence[str] = (),
    startup_timeout_s: float = 600.0,
) -> Iterator[LocalServer]:
    """A vLLM server on a free port of 127.0.0.1 for the RL run that `config_args` (fnt rl's
    --config and --key=value arguments) describe, started with `fnt vllm-serve` in a process
    group of its own, its output written to `log`. Yields it once /health answers; stops it on
    exit. RuntimeError with the log's end when it exits or is not up in time."""
    from fnt.rollout.engines.vllm import RequestFailed, http_json

    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "fnt", "vllm-serve", *config_args]
    command += ["--rollout.engine", "vllm", "--rollout.vllm.urls", json.dumps([url])]
    if vllm:
        command += ["--vllm", vllm]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*command, "--", *extra], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = LocalServer(url, process)
    try:
        started = time.monotonic()
        while True:
            try:
                http_json(url + "/health", None, 10.0)
                break
            except RequestFailed:
                pass
            exited = process.poll() is not None
            if exited or time.monotonic() - started > startup_timeout_s:
                state = "exited" if exited else f"was not healthy after {startup_timeout_s:g} s"
                tail = log.read_text(errors="replace")[-6000:]
                raise RuntimeError(f"the vLLM server at {url} {state}; the end of {log}:\n{tail}")
            time.sleep(1.0)
        yield server
    finally:
        server.stop()
