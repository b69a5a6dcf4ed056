"""Building the native kernel: toolchain errors name what is missing; cache location and key."""

from __future__ import annotations

import sys

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
