"""`fnt rl --list-environments`: the environments rollout.environment can name (the table of
fnt.config.environments), whether each one's extra is installed, and what an installed
integration offers (reasoning-gym's task names). Side effects: imports installed integrations
to list their names; prints."""

from __future__ import annotations

import textwrap
from importlib.metadata import PackageNotFoundError, version

from fnt.config.environments import ENVIRONMENTS, EnvironmentKind, is_installed
from fnt.config.references import import_function


def install_status(kind: EnvironmentKind) -> str:
    """ "built in", "installed (NAME VERSION)" or how to install it."""
    if not kind.requires:
        return "built in"
    if not is_installed(kind):
        return f"not installed: pip install 'fnt[{kind.extra}]'"
    try:
        return f"installed ({kind.distribution} {version(kind.distribution)}, extra '{kind.extra}')"
    except PackageNotFoundError:  # importable without package metadata (a source checkout)
        return f"installed ({kind.requires}, extra '{kind.extra}')"


def environments_listing() -> str:
    """The text --list-environments prints: one block per environment."""
    blocks = []
    for kind in ENVIRONMENTS:
        lines = [
            f"{kind.name}: {install_status(kind)}",
            f"  rollout.environment = {kind.spelling}",
            *textwrap.wrap(kind.summary, 96, initial_indent="  ", subsequent_indent="  "),
        ]
        if kind.names and is_installed(kind):
            names = import_function(kind.names, 0)()
            listed = f"{len(names)} names: {', '.join(names)}"
            lines += textwrap.wrap(listed, 96, initial_indent="  ", subsequent_indent="    ")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main() -> None:
    print(environments_listing())
