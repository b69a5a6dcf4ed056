"""Builds and loads the native CPU AdamW kernel (adamw.cpp, shipped next to this module).
Side effects: on first use in a process, compiles the extension with the system C++ compiler and
ninja into a cache directory (``$FNT_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/fnt/native``, else
``~/.cache/fnt/native``) and imports it. It may prepend the running interpreter's bin directory
to ``PATH`` when ninja is installed there but not on ``PATH`` (a virtualenv used without
activating it), because torch's builder runs ninja from ``PATH``. It reads ``$CXX`` and
/proc/cpuinfo (the cache key), and holds a lock file in the cache directory while it builds.

Builds of one cache directory are serialised by an ``fcntl.flock`` on ``fnt-build.lock`` in it
(`build_lock`), taken with a timeout; holding it, a build removes the lock file that torch's
builder leaves behind when it is killed mid-build (with a warning), which would otherwise make
every later build wait for it forever.

The build is specialised to this CPU (``-march=native``), so the cache key includes the CPU's
feature flags next to the source, compiler, torch and Python versions: a cache directory shared
across machines holds one build per kind of CPU and never loads code a CPU cannot run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

SOURCE = Path(__file__).resolve().with_name("adamw.cpp")
BUILD_LOCK = "fnt-build.lock"
# The file torch.utils.cpp_extension creates in the build directory while it builds (a FileBaton)
# and removes afterwards; its waiters poll until it is gone.
TORCH_LOCK = "lock"
# A first build takes a minute or two; a wait far beyond that is a hung or stuck builder.
BUILD_LOCK_TIMEOUT_S = 900.0
_POLL_S = 0.1


class NativeBuildError(RuntimeError):
    """The native kernel cannot be built here (missing compiler or ninja, or a failed build)."""


def cache_root() -> Path:
    """Directory that holds the builds; pure apart from reading the environment."""
    if override := os.environ.get("FNT_NATIVE_CACHE"):
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fnt" / "native"


def find_compiler() -> str:
    """Path of the C++ compiler torch will use ($CXX, else c++); raises NativeBuildError."""
    requested = os.environ.get("CXX") or "c++"
    words = shlex.split(requested)
    found = shutil.which(words[0]) if words else None
    if found is None:
        others = [c for c in ("g++", "clang++") if shutil.which(c)]
        remedy = (
            f"set CXX={others[0]}" if others else "install g++ or clang++ (or point CXX at one)"
        )
        source = "from $CXX" if os.environ.get("CXX") else "the default"
        raise NativeBuildError(
            f"CPUAdamW(impl='native') compiles its kernel on first use, but the C++ compiler "
            f"{requested!r} ({source}) was not found on PATH: {remedy}, or use impl='reference'."
        )
    return found


def find_ninja() -> str:
    """Path of ninja, preferring PATH, then the interpreter's bin directory (see module doc)."""
    found = shutil.which("ninja")
    if found is not None:
        return found
    beside_python = Path(sys.executable).parent / "ninja"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        os.environ["PATH"] = f"{beside_python.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return str(beside_python)
    raise NativeBuildError(
        "CPUAdamW(impl='native') compiles its kernel on first use with ninja, which was not "
        "found on PATH. Install it (pip install ninja) or use impl='reference'."
    )


def _cpu_identity() -> str:
    """The CPU features -march=native specialises for."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build_flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags; pure."""
    cflags = ["-O3", "-fno-math-errno", "-ffp-contract=off"]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        cflags.append("-march=native")
    elif machine in ("aarch64", "arm64"):
        cflags.append("-mcpu=native")
    ldflags: list[str] = []
    # at::parallel_for is an inline `#pragma omp parallel` when torch uses OpenMP; without
    # -fopenmp it silently runs on one thread. The extension then binds to the libgomp torch
    # has already loaded (same soname), so there is one thread pool.
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def cache_key(compiler: str, cflags: list[str]) -> str:
    """Hash of everything the built binary depends on."""
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__,
        sys.version,
        compiler,
        " ".join(cflags),
        _cpu_identity(),
    ):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float = BUILD_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold `build_dir` for this process's build, waiting at most `timeout_s` for another one.

    The lock is an ``fcntl.flock``, so it dies with its process however that process dies: its
    holder is the only builder alive, and torch's lock file found then was left by a killed
    build. It is removed with a warning. Raises NativeBuildError, naming the holder (host and
    pid, written into the lock file), when the wait times out.
    """
    path = build_dir / BUILD_LOCK
    # Not truncated on open: while another process holds the lock its text must stay readable.
    handle = open(path, "a+", encoding="utf-8")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "another process"
                    raise NativeBuildError(
                        f"waited {timeout_s:.0f} s for {holder} to finish building the native "
                        f"AdamW kernel in {build_dir} (lock {path}): stop that process, or use "
                        "optim.impl = 'reference'"
                    ) from None
                time.sleep(_POLL_S)
        handle.truncate(0)
        handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        handle.flush()
        stale = build_dir / TORCH_LOCK
        if stale.exists():
            warnings.warn(
                f"removing {stale}: a native build that was killed left it, and no build is "
                "running now",
                stacklevel=3,
            )
            stale.unlink(missing_ok=True)
        yield
    finally:
        handle.close()


@functools.cache
def load() -> ModuleType:
    """The compiled extension, building it into the cache on first use (see module doc)."""
    from torch.utils import cpp_extension

    compiler = find_compiler()
    find_ninja()
    cflags, ldflags = build_flags()
    key = cache_key(compiler, cflags)
    build_dir = cache_root() / f"adamw-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir):
        try:
            return cpp_extension.load(
                name=f"fnt_adamw_{key}",
                sources=[str(SOURCE)],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                verbose=False,
            )
        except (RuntimeError, OSError) as e:
            raise NativeBuildError(
                f"building the native AdamW kernel in {build_dir} failed: {e}. "
                "CPUAdamW(impl='reference') needs no compiler."
            ) from e
