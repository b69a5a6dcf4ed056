"""The layout's rules, read from the source (ast): each folder of fnt/ is a layer, and a module
imports only from its own layer or lower ones; only the composition root imports plugins; no
import circle, not even through an import inside a function; only the `fnt` command imports
`steps`. docs/design.md explains the layers; its layout block is generated from the folders."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("records", ("fnt", "fnt.errors", "fnt.faults", "fnt.batch", "fnt.state")),
    ("config", ("fnt.config",)),
    ("store", ("fnt.store",)),
    ("optim", ("fnt.native", "fnt.optim")),
    ("model", ("fnt.model",)),
    ("distributed", ("fnt.distributed",)),
    ("obs", ("fnt.obs",)),
    ("data", ("fnt.data",)),
    ("rollout", ("fnt.rollout",)),
    (
        "core",
        (
            "fnt.sources",
            "fnt.loop",
            "fnt.update",
            "fnt.schedule",
            "fnt.start",
            "fnt.build",
            "fnt.resume",
            "fnt.checkpoint",
            "fnt.run_context",
            "fnt.rows",
            "fnt.evaluation",
            "fnt.preference",
        ),
    ),
    ("apps", ("fnt.apps", "fnt.__main__")),
    ("testing", ("fnt.testing",)),
)
# The implementations the core knows by protocol only (fnt.state), and the one core module that
# chooses and builds them. fnt.evaluation is a core package (the driver's side, which fnt.rows
# uses) whose modules are plugins: the held-out data of each mode.
PLUGINS = ("fnt.data", "fnt.rollout", "fnt.evaluation.held_out", "fnt.evaluation.pairs")
COMPOSITION_ROOT = "fnt.build"


def module_files() -> dict[str, Path]:
    """Every module of the fnt package, by name."""
    files = {}
    for path in (ROOT / "fnt").rglob("*.py"):
        parts = ["fnt", *path.relative_to(ROOT / "fnt").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if within(module, prefix)
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each import of fnt or steps in the file;
    imports made for annotations only (`if TYPE_CHECKING:`) are left out."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function = True
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from fnt.model import tiny_model` imports the submodule fnt.model.tiny_model
            targets = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        for target in targets:
            if within(target, "fnt") or within(target, "steps"):
                found.append((target, node.lineno, in_function))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(path.read_text()), False)
    return found


@cache
def import_graph() -> dict[str, list[tuple[str, int, bool]]]:
    files = module_files()
    names = set(files)
    return {module: imports_of(path, names) for module, path in sorted(files.items())}


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_a_layer_imports_only_from_itself_and_lower_layers(layer):
    index = [name for name, _ in LAYERS].index(layer)
    upward = [
        f"{module}:{line} imports {target} (layer {LAYERS[layer_of(target)][0]})"
        for module, imports in import_graph().items()
        if layer_of(module) == index
        for target, line, _ in imports
        if within(target, "fnt") and layer_of(target) > index
    ]
    assert upward == []


def test_only_the_composition_root_imports_plugins():
    core = [n for n, (name, _) in enumerate(LAYERS) if name == "core"][0]
    offending = [
        f"{module}:{line} imports {target}"
        for module, imports in import_graph().items()
        if layer_of(module) == core
        and module != COMPOSITION_ROOT
        and not any(within(module, p) for p in PLUGINS)
        for target, line, _ in imports
        if any(within(target, p) for p in PLUGINS)
    ]
    assert offending == []


def test_no_import_circle_not_even_through_an_import_inside_a_function():
    graph = {
        module: sorted({t for t, _, _ in imports if t in import_graph() and t != module})
        for module, imports in import_graph().items()
    }
    state: dict[str, str] = {}
    circles = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                walk(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            walk(module, [module])
    assert circles == []


def test_only_the_fnt_command_imports_steps():
    importers = sorted(
        module
        for module, imports in import_graph().items()
        if any(within(target, "steps") for target, _, _ in imports)
    )
    assert importers == ["fnt.__main__"]


def test_every_module_is_in_a_layer_and_the_top_level_is_the_core():
    for module in import_graph():
        layer_of(module)
    top_level = {p.stem for p in (ROOT / "fnt").glob("*.py")} - {"__init__", "__main__"}
    core_and_records = {
        prefix.removeprefix("fnt.")
        for name, prefixes in LAYERS
        if name in ("records", "core")
        for prefix in prefixes
        if prefix != "fnt"
    }
    # A core package (fnt.evaluation) is a folder at the top, not a module there.
    core_packages = {name for name in core_and_records if (ROOT / "fnt" / name).is_dir()}
    assert top_level | core_packages == core_and_records
    assert all((ROOT / "fnt" / name / "__init__.py").is_file() for name in core_packages)


def test_the_rules_see_an_upward_import_and_a_circle(tmp_path):
    """The rules above would catch a violation: a model module importing the driver, and two
    modules importing each other from inside functions."""
    upward = tmp_path / "upward.py"
    upward.write_text("def f():\n    from fnt.loop import run\n")
    names = set(module_files())
    [(target, line, inside)] = imports_of(upward, names)
    assert (target, line, inside) == ("fnt.loop", 2, True)
    assert layer_of(target) > layer_of("fnt.model.lora")
    guarded = tmp_path / "guarded.py"
    guarded.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fnt.loop\n")
    assert imports_of(guarded, names) == []


# In one fresh interpreter: the core first (which plugins did it load?), then every library
# module but the command line (is `steps` loaded?).
IMPORTS_PROBE = """
import importlib, json, pkgutil, sys
for module in {core!r}:
    importlib.import_module(module)
plugins = sorted(m for m in sys.modules if m.startswith({plugins!r}))
import fnt
for m in pkgutil.walk_packages(fnt.__path__, "fnt."):
    if m.name != "fnt.__main__":
        importlib.import_module(m.name)
print(json.dumps({{"plugins_of_the_core": plugins, "steps": "steps" in sys.modules}}))
"""


def test_importing_the_core_loads_no_plugin_and_the_library_never_loads_steps():
    core = [
        prefix
        for name, prefixes in LAYERS
        if name == "core"
        for prefix in prefixes
        if prefix != COMPOSITION_ROOT and not any(within(prefix, p) for p in PLUGINS)
    ]
    assert all(importlib.util.find_spec(m) for m in core)
    probe = IMPORTS_PROBE.format(core=tuple(core), plugins=PLUGINS)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"plugins_of_the_core": [], "steps": False}


def test_a_submodule_of_fnt_model_loads_without_the_loader():
    """fnt.model's lazy names (the module it replaced) must not load fnt.model.loading, and
    torch with it, for `from fnt.model import tiny_model`."""
    probe = (
        "import sys; from fnt.model import tiny_model; "
        "print('fnt.model.loading' in sys.modules, tiny_model.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "fnt.model.tiny_model"], done.stderr


def test_the_export_module_loads_without_torch():
    """`fnt export` checks its inputs and creates --out before torch is imported: it calls
    fnt.apps.export.export_hf_, whose module must not load torch."""
    probe = "import sys, fnt.apps.export; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["False"], done.stderr
