"""Regenerate the generated parts of README.md and docs/design.md (writes both): the config
keys, from the config dataclasses, the resume policy, from `fnt.resume.RESUME_POLICY`, the
public API, from the docstrings of what `fnt` exports, and the layout, from the folders and the
docstrings of their packages and modules."""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

from fnt.config import markdown_keys

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
KEYS_BLOCK = re.compile(r"(<!-- config-keys:start -->\n).*?(<!-- config-keys:end -->)", re.S)
API_BLOCK = re.compile(r"(<!-- api:start -->\n).*?(<!-- api:end -->)", re.S)
RESUME_BLOCK = re.compile(r"(<!-- resume-policy:start -->\n).*?(<!-- resume-policy:end -->)", re.S)
LAYOUT_BLOCK = re.compile(r"(<!-- layout:start -->\n).*?(<!-- layout:end -->)", re.S)
MODULES_BLOCK = re.compile(r"(<!-- modules:start -->\n).*?(<!-- modules:end -->)", re.S)
# The folders of Python code: the library and the step functions.
CODE_FOLDERS = ("fnt", "steps")
CORE = (
    "the core: the records, the fold and the driver, the step kit, the run's start, "
    "checkpoints and resume"
)
# Public names outside `fnt.__all__`: the step functions and the native optimizer.
EXTRA_API = (
    ("steps", "sft_step"),
    ("steps", "rl_step"),
    ("steps", "dpo_step"),
    ("fnt.optim", "CPUAdamW"),
)


def summary(obj) -> str:
    """The first sentence of an object's docstring, on one line."""
    paragraph = " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())
    sentence, dot, _ = paragraph.partition(". ")
    return sentence + ("." if dot or not sentence.endswith(".") else "")


def docstring_summary(path: Path) -> str:
    """The first sentence of a module's docstring (of a C++ file's leading comment), read
    without importing it."""
    if path.suffix == ".cpp":
        lines = path.read_text().splitlines()
        doc = "\n".join(line.removeprefix("//").strip() for line in lines if line.startswith("//"))
    else:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    return summary(types.SimpleNamespace(__doc__=doc))


def packages() -> list[Path]:
    """Every package folder of the code, in path order."""
    return sorted(
        init.parent.relative_to(ROOT)
        for top in CODE_FOLDERS
        for init in (ROOT / top).rglob("__init__.py")
    )


def modules_of(package: Path) -> list[Path]:
    """The package's modules (and C++ sources), without its __init__.py."""
    files = [*(ROOT / package).glob("*.py"), *(ROOT / package).glob("*.cpp")]
    return sorted(p for p in files if p.name != "__init__.py")


def folder_summary(package: Path) -> str:
    if package == Path("fnt"):
        return CORE[0].upper() + CORE[1:] + "."
    return docstring_summary(ROOT / package / "__init__.py")


def markdown_layout() -> str:
    """README's layout: each folder of code and what it holds."""
    lines = ["| folder | what it holds | modules |", "| --- | --- | --- |"]
    for package in packages():
        names = ", ".join(f"`{p.name}`" for p in modules_of(package))
        lines.append(f"| `{package}/` | {folder_summary(package)} | {names} |")
    return "\n".join(lines)


def markdown_modules() -> str:
    """design.md's layout: every module of every folder with the first sentence of its docstring."""
    parts = []
    for package in packages():
        rows = [f"| `{p.name}` | {docstring_summary(p)} |" for p in modules_of(package)]
        parts.append(
            f"`{package}/`: {folder_summary(package)}\n\n| module | what it is |\n| --- | --- |\n"
            + "\n".join(rows)
        )
    return "\n\n".join(parts)


def markdown_api() -> str:
    import fnt

    rows = [("fnt", name) for name in fnt.__all__] + list(EXTRA_API)
    lines = ["| name | import | what it is |", "| --- | --- | --- |"]
    for module, name in rows:
        obj = getattr(importlib.import_module(module), name)
        lines.append(f"| `{name}` | `from {module} import {name}` | {summary(obj)} |")
    return "\n".join(lines)


def markdown_resume_policy() -> str:
    from fnt.resume import POLICY_MEANINGS, RESUME_POLICY

    lines = ["| a key that differs from the checkpoint's | keys |", "| --- | --- |"]
    for policy, meaning in POLICY_MEANINGS.items():
        keys = ", ".join(f"`{key}`" for key, p in RESUME_POLICY.items() if p == policy)
        lines.append(f"| {meaning} | {keys} |")
    return "\n".join(lines)


def with_tables(text: str) -> str:
    note = (
        "Keys of the `loss` and `rollout` sections apply to `fnt rl` only, those of the `dpo` "
        "section to `fnt dpo` only.\n\n"
    )
    text = KEYS_BLOCK.sub(lambda m: m.group(1) + note + markdown_keys() + "\n" + m.group(2), text)
    text = RESUME_BLOCK.sub(
        lambda m: m.group(1) + markdown_resume_policy() + "\n" + m.group(2), text
    )
    text = LAYOUT_BLOCK.sub(lambda m: m.group(1) + markdown_layout() + "\n" + m.group(2), text)
    return API_BLOCK.sub(lambda m: m.group(1) + markdown_api() + "\n" + m.group(2), text)


def with_modules(text: str) -> str:
    return MODULES_BLOCK.sub(lambda m: m.group(1) + markdown_modules() + "\n" + m.group(2), text)


if __name__ == "__main__":
    README.write_text(with_tables(README.read_text()))
    DESIGN.write_text(with_modules(DESIGN.read_text()))
