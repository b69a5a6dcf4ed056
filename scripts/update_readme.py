"""Regenerate the generated tables of README.md and docs/ (writes each page that holds one,
`PAGES`): the layout (README), from the folders and the docstrings of their packages and
modules; the config keys, from the config dataclasses, and the TRL/transformers names, from
`fnt.config.aliases.ALIASES` and `NO_EQUIVALENT` (docs/configuration.md); the resume policy, from
`fnt.resume.RESUME_POLICY` (docs/run-directory.md); the public API, from the docstrings of what
`fnt` exports (docs/api.md); every module (docs/design.md).

A table sits between `<!-- NAME:start -->` and `<!-- NAME:end -->`; what is between is replaced."""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

from fnt.config import markdown_keys

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
CONFIGURATION = DOCS / "configuration.md"
RUN_DIRECTORY = DOCS / "run-directory.md"
API = DOCS / "api.md"
# Each page and the generated tables it holds (each table in one page only).
PAGES = {
    README: ("layout",),
    CONFIGURATION: ("aliases", "no-equivalent", "config-keys"),
    RUN_DIRECTORY: ("resume-policy",),
    API: ("api",),
    DESIGN: ("modules",),
}
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


def markdown_aliases() -> str:
    """configuration.md's table of the names TRL and transformers use, and fnt's key for each."""
    from fnt.config.aliases import ALIASES, aliases_of

    lines = ["| their name | fnt's key | how fnt differs |", "| --- | --- | --- |"]
    for name in ALIASES:
        for alias in aliases_of(name):
            value = f' = "{alias.value}"' if alias.value is not None else ""
            lines.append(f"| `{name}` | `{alias.key}`{value} | {alias.note} |")
    return "\n".join(lines)


def markdown_no_equivalent() -> str:
    """configuration.md's table of the TRL/transformers names fnt has no key for."""
    from fnt.config.aliases import NO_EQUIVALENT

    lines = ["| their name | what fnt answers |", "| --- | --- |"]
    lines += [f"| `{name}` | {sentence} |" for name, sentence in NO_EQUIVALENT.items()]
    return "\n".join(lines)


def markdown_config_keys() -> str:
    note = (
        "Keys of the `loss` and `rollout` sections apply to `fnt rl` only, those of the `dpo` "
        "section to `fnt dpo` only.\n\n"
    )
    return note + markdown_keys()


def markdown_resume_policy() -> str:
    from fnt.resume import POLICY_MEANINGS, RESUME_POLICY

    lines = ["| a key that differs from the checkpoint's | keys |", "| --- | --- |"]
    for policy, meaning in POLICY_MEANINGS.items():
        keys = ", ".join(f"`{key}`" for key, p in RESUME_POLICY.items() if p == policy)
        lines.append(f"| {meaning} | {keys} |")
    return "\n".join(lines)


GENERATORS = {
    "layout": markdown_layout,
    "aliases": markdown_aliases,
    "no-equivalent": markdown_no_equivalent,
    "config-keys": markdown_config_keys,
    "resume-policy": markdown_resume_policy,
    "api": markdown_api,
    "modules": markdown_modules,
}
"""Each generated table by the name of its block."""


def block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)


def with_tables(text: str) -> str:
    """`text` with every generated table it holds regenerated (the others are not computed)."""
    for name, generate in GENERATORS.items():
        pattern = block(name)
        if pattern.search(text):
            table = generate()
            text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


if __name__ == "__main__":
    for page in PAGES:
        page.write_text(with_tables(page.read_text()))
