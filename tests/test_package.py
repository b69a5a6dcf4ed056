"""The wheel ships the native kernel's source and the `fnt` command, and a non-editable install of
it builds and runs the kernel outside the repository; a checkout imports every package without
an install (a bare GPU machine runs the checkout through PYTHONPATH)."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh virtualenv that holds only the wheel: one native step, checked against the
# reference implementation, and where fnt and the kernel source were loaded from.
NATIVE_STEP = """
import json, torch, fnt
from fnt.native import build
from fnt.optim.adamw import CPUAdamW

params = {}
for impl in ("native", "reference"):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 1000))
    p.grad = torch.linspace(0.5, -0.5, 1000)
    CPUAdamW([p], lr=0.1, impl=impl).step()
    params[impl] = p.detach()
print(json.dumps({
    "fnt": fnt.__file__,
    "source": str(build.SOURCE),
    "equal": torch.equal(params["native"], params["reference"]),
    "moved": not torch.equal(params["native"], torch.linspace(-1, 1, 1000)),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy without build/ or caches: setuptools would ship stale modules left in
    # build/lib by an earlier build.
    source = tmp_path_factory.mktemp("source") / "fnt"
    junk = shutil.ignore_patterns(
        ".git",
        ".venv*",
        ".gpu-wheels",
        "build",
        "runs",
        "*.egg-info",
        "__pycache__",
        ".*cache",
        ".hypothesis",
    )
    shutil.copytree(REPO, source, ignore=junk)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(out)],
        cwd=source,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("fnt-*.whl")
    return built


def test_the_wheel_ships_the_kernel_source_and_the_fnt_command(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(z.read(entry_points).decode())
    assert {"fnt/native/adamw.cpp", "fnt/native/build.py", "fnt/__main__.py"} <= names
    assert {n.split("/")[0] for n in names if "dist-info" not in n} == {"fnt", "steps"}
    assert "fnt/model/tiny_model.py" in names  # the tests' and the demo's models come from it
    assert scripts["console_scripts"]["fnt"] == "fnt.__main__:main"
    # Nothing but the sources of this tree: no module a rename left behind in a build dir.
    modules = {n for n in names if n.endswith(".py")}
    missing = [n for n in modules if not (REPO / n).is_file()]
    assert missing == []


def test_pyproject_lists_every_package_of_the_tree():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("fnt", "steps")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert listed == found


def test_a_checkout_imports_every_package_through_pythonpath_alone(tmp_path):
    """-S: no site-packages, so no editable install's finder; only the checkout on the path."""
    code = (
        "import fnt.native.build, fnt.optim, steps, fnt.model.attention; "
        "print(fnt.native.build.SOURCE)"
    )
    site_packages = sysconfig.get_paths()["purelib"]
    out = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path += [{site_packages!r}]; {code}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == REPO / "fnt" / "native" / "adamw.cpp"


@pytest.mark.slow
def test_a_non_editable_install_builds_and_runs_the_native_kernel(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index"]
        + ["--no-deps", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # torch, transformers and the rest come from this virtualenv, through a path line in a .pth
    # file: it is searched after the fresh site-packages, so the wheel's fnt wins, and, unlike a
    # site directory, it runs none of the .pth files there, so the editable fnt stays out.
    fresh_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(fresh_site) / "fnt-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    ninja_dir = Path(shutil.which("ninja") or Path(sys.executable).parent / "ninja").parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{ninja_dir}{os.pathsep}{env.get('PATH', '')}"
    env["FNT_NATIVE_CACHE"] = str(tmp_path / "cache")  # a real build from the wheel's source
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    proc = subprocess.run(
        [python, "-c", NATIVE_STEP],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["fnt"]).is_relative_to(venv), result
    assert Path(result["source"]).is_relative_to(venv) and Path(result["source"]).is_file()
    assert result["equal"] and result["moved"], result
    help_proc = subprocess.run(
        [venv / "bin" / "fnt", "--help"], cwd=outside, env=env, capture_output=True, text=True
    )
    assert help_proc.returncode == 0 and "make-tiny-model" in help_proc.stdout
