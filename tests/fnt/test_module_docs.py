"""Module docstrings tell the truth about side effects (docs/design.md, "Conventions").

Every module of fnt/ and steps/ says, in the first paragraph of its docstring, "Pure" or "Side
effects" (or "Side effect"), capitalized, so that `grep -n "Pure\\|Side effect"` finds each
claim. A first paragraph that says plain "Pure" (no "except", "apart from", "but" and no "Side
effect") is checked against the code: no function of the module, and no code at its top level,
may reach a call with a side effect (a file read or written, a directory listed, a process, a
collective, an import of a module named at run time, the environment, printing, a hook), directly
or through the functions of fnt and steps it imports by name. That check reads the source (ast)
and follows calls it can resolve; it cannot see a call through an object of another module, so
it finds a false "Pure" often, not always."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fnt", "steps")

CLAIM = re.compile(r"\b(Pure|Side effects?)\b")
QUALIFIED = re.compile(r"\b(except|apart from|but)\b|Side effects?")

# Calls with a side effect, by the called name (a builtin) or attribute (`os.environ` is read).
SIDE_EFFECT_NAMES = frozenset({"open", "print", "input", "exec", "exit", "__import__"})
SIDE_EFFECT_ATTRIBUTES = frozenset(
    {
        # files and directories
        "write_text", "write_bytes", "read_text", "read_bytes", "mkdir", "makedirs", "unlink",
        "rename", "rmtree", "touch", "chmod", "utime", "fsync", "flock", "stat", "iterdir",
        "listdir", "scandir", "glob", "rglob", "isdir", "isfile", "exists", "is_file", "is_dir",
        "getsource", "from_pretrained", "safe_open", "load_file", "save_file",
        # imports named at run time
        "import_module", "find_spec",
        # processes, signals, the environment
        "system", "Popen", "check_call", "check_output", "execvp", "kill", "signal", "exit",
        "getenv", "addaudithook",
        # collectives
        "all_reduce", "all_gather", "all_gather_object", "all_to_all", "broadcast",
        "broadcast_object_list", "reduce_scatter", "barrier",
        # hooks on modules
        "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    }
)  # fmt: skip


def module_files() -> dict[str, Path]:
    """Every module of fnt and steps, by name."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


@cache
def trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in module_files().items()}


def first_paragraph(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def says_plain_pure(paragraph: str) -> bool:
    return "Pure" in paragraph and not QUALIFIED.search(paragraph)


Key = tuple[str, str]  # (module, function); "Class.method"; "<module>" is the top-level code


def direct_effects(node: ast.AST) -> list[str]:
    """The side-effecting calls (and environment reads) written in `node`, with their lines."""
    found = []
    for child in ast.walk(node):
        if isinstance(child, ast.Attribute) and child.attr == "environ":
            found.append(f"os.environ (line {child.lineno})")
        if not isinstance(child, ast.Call):
            continue
        func = child.func
        if isinstance(func, ast.Name) and func.id in SIDE_EFFECT_NAMES:
            found.append(f"{func.id}() (line {child.lineno})")
        elif isinstance(func, ast.Attribute) and func.attr in SIDE_EFFECT_ATTRIBUTES:
            found.append(f"{ast.unparse(func)}() (line {child.lineno})")
    return found


@cache
def call_graph() -> tuple[dict[Key, list[str]], dict[Key, set[Key]]]:
    """Per function of every module: its own side-effecting calls, and the functions of fnt and
    steps it calls that can be resolved (its module's, its class's through self, and those
    imported by name; calling a class calls its __init__ and __post_init__)."""
    effects: dict[Key, list[str]] = {}
    calls: dict[Key, set[Key]] = {}
    for module, tree in trees().items():
        imported: dict[str, Key] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in PACKAGES:
                    for alias in node.names:
                        imported[alias.asname or alias.name] = (node.module, alias.name)
        functions: dict[str, ast.AST] = {}
        classes: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                classes.add(node.name)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        functions[f"{node.name}.{item.name}"] = item
        top_level = ast.Module(
            body=[
                n
                for n in tree.body
                if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ],
            type_ignores=[],
        )
        for name, node in [*functions.items(), ("<module>", top_level)]:
            key = (module, name)
            effects[key] = direct_effects(node)
            callees: set[Key] = set()
            for child in ast.walk(node):
                if not isinstance(child, ast.Call):
                    continue
                func = child.func
                if isinstance(func, ast.Name):
                    if func.id in imported:
                        callees.add(imported[func.id])
                    elif func.id in functions:
                        callees.add((module, func.id))
                    elif func.id in classes:
                        callees |= {
                            (module, f"{func.id}.__init__"),
                            (module, f"{func.id}.__post_init__"),
                        }
                elif (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "self"
                    and "." in name
                ):
                    callees.add((module, f"{name.split('.')[0]}.{func.attr}"))
            calls[key] = callees
    # An imported class: its constructor.
    for key, callees in calls.items():
        for callee in list(callees):
            if callee not in calls:
                callees |= {
                    (callee[0], f"{callee[1]}.__init__"),
                    (callee[0], f"{callee[1]}.__post_init__"),
                }
    return effects, calls


def reached_effect(key: Key) -> str | None:
    """A side effect `key` reaches, as "path: what", or None."""
    effects, calls = call_graph()
    seen: set[Key] = set()
    stack: list[tuple[Key, str]] = [(key, f"{key[0]}.{key[1]}")]
    while stack:
        current, path = stack.pop()
        if current in seen or current not in calls:
            continue
        seen.add(current)
        if effects[current]:
            return f"{path}: {effects[current][0]}"
        for callee in sorted(calls[current]):
            stack.append((callee, f"{path} -> {callee[0]}.{callee[1]}"))
    return None


def test_every_module_says_pure_or_names_its_side_effects():
    silent = [
        f"{module_files()[name].relative_to(ROOT)}: {first_paragraph(tree)[:70]!r}"
        for name, tree in trees().items()
        if not CLAIM.search(first_paragraph(tree))
    ]
    assert not silent, (
        'the first paragraph of each module docstring says "Pure" or "Side effects: ..." '
        "(docs/design.md, Conventions); these do not:\n" + "\n".join(silent)
    )


def test_a_module_that_says_pure_reaches_no_side_effect():
    false_claims = []
    for name, tree in trees().items():
        if not says_plain_pure(first_paragraph(tree)):
            continue
        for module, function in call_graph()[1]:
            if module == name and (effect := reached_effect((module, function))):
                false_claims.append(effect)
    assert not false_claims, (
        'these modules say plain "Pure" but reach a side effect (say "Pure, except ..." or '
        '"Side effects: ..."):\n' + "\n".join(false_claims)
    )


def test_the_rules_see_a_silent_module_and_a_false_pure():
    silent = ast.parse('"""Helpers for the loop."""\n')
    assert not CLAIM.search(first_paragraph(silent))
    assert CLAIM.search(first_paragraph(ast.parse('"""Helpers.\nSide effects: prints."""')))
    assert not CLAIM.search(
        first_paragraph(ast.parse('"""Helpers.\n\nSide effects: in the second paragraph."""'))
    )
    assert says_plain_pure("The schedule. Pure.")
    assert not says_plain_pure("The cache. Pure, except `load`, which reads a file.")
    assert not says_plain_pure("The runtime. Side effects: the process group.")
    writes = ast.parse(
        "import os\ndef f(path):\n    if os.path.isdir(path):\n        print(path)\n"
    )
    assert [e.split(" (")[0] for e in direct_effects(writes)] == ["os.path.isdir()", "print()"]
    assert direct_effects(ast.parse("def f(x):\n    return sorted(x)\n")) == []


def test_the_call_graph_follows_imports_into_fnt():
    # fnt.config.references.require_function imports a module: what calls it is not pure.
    effect = reached_effect(("fnt.config.references", "require_function"))
    assert effect is not None and "import_module" in effect
    assert reached_effect(("fnt.schedule", "lr_at")) is None
