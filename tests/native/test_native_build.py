"""Building the native kernel: toolchain errors name what is missing; cache location and key."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fnt.native import build as _native
from fnt.optim.adamw import CPUAdamW


def test_missing_compiler_from_cxx_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "fnt-no-such-compiler++")
    with pytest.raises(_native.NativeBuildError, match=r"'fnt-no-such-compiler\+\+'.*from \$CXX"):
        _native.find_compiler()


def test_missing_default_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(_native.NativeBuildError, match=r"'c\+\+' \(the default\)"):
        _native.find_compiler()


def test_missing_ninja_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(_native.NativeBuildError, match="ninja"):
        _native.find_ninja()


def test_building_without_a_compiler_fails_with_the_named_compiler(monkeypatch):
    # load() is cached per process; its undecorated body is what a fresh process runs.
    monkeypatch.setenv("CXX", "fnt-no-such-compiler++")
    with pytest.raises(_native.NativeBuildError, match="fnt-no-such-compiler"):
        _native.load.__wrapped__()


def test_reference_impl_never_builds(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: pytest.fail("reference impl built the kernel"))
    CPUAdamW([torch.zeros(2, requires_grad=True)], impl="reference")


def test_cache_root_honours_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("FNT_NATIVE_CACHE", str(tmp_path / "mine"))
    assert _native.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("FNT_NATIVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native.cache_root() == tmp_path / "xdg" / "fnt" / "native"


def test_cache_key_separates_cpus_and_flags(monkeypatch):
    cflags, _ = _native.build_flags()
    key = _native.cache_key("/usr/bin/c++", cflags)
    assert key == _native.cache_key("/usr/bin/c++", cflags)
    assert key != _native.cache_key("/usr/bin/c++", [*cflags, "-DX"])
    monkeypatch.setattr(_native, "_cpu_identity", lambda: "some other cpu")
    assert key != _native.cache_key("/usr/bin/c++", cflags)


def test_the_build_lock_removes_a_stale_torch_lock_with_one_warning(tmp_path):
    (tmp_path / _native.TORCH_LOCK).write_text("")  # what a build killed mid-way leaves
    with pytest.warns(UserWarning, match="killed") as caught:
        with _native.build_lock(tmp_path):
            assert not (tmp_path / _native.TORCH_LOCK).exists()
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stale lock: no warning
        with _native.build_lock(tmp_path):
            pass


def test_the_build_lock_waits_for_a_live_builder_only_until_the_timeout(tmp_path):
    with _native.build_lock(tmp_path):
        # A second holder (a flock is per open file, so this process can stand in for another).
        with pytest.raises(_native.NativeBuildError, match=rf"pid {os.getpid()}.*{tmp_path}"):
            with _native.build_lock(tmp_path, timeout_s=0.3):
                pass
    with _native.build_lock(tmp_path, timeout_s=0.3):  # released with its holder
        pass


def test_a_build_killed_mid_way_does_not_block_later_builds(tmp_path):
    """torch's builder waits as long as its lock file exists; a killed build leaves it."""
    built = Path(_native.load().__file__).parent  # built (or found) in the real cache
    cache = tmp_path / "cache"
    shutil.copytree(built, cache / built.name)  # up to date there: no compile
    (cache / built.name / _native.TORCH_LOCK).write_text("")
    proc = subprocess.run(
        [sys.executable, "-c", "from fnt.native.build import load; print(load().__file__)"],
        env={**os.environ, "FNT_NATIVE_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(cache / built.name))
    assert proc.stderr.count("a native build that was killed left it") == 1, proc.stderr
