"""Command-line front end shared by the `fnt` commands. Side effects: prints, exits.

Parsing and validation happen before torch or transformers are imported, so a bad command
line exits with status 2 within about a second.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fnt.config import CliArgs, Config, help_text, load_config, to_json, validate
from fnt.errors import ConfigError, DataError

EXIT_BAD_INPUT = 2


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Turn a ConfigError or DataError into `error: <message>` on stderr and exit status 2.

    Both are the user's input, not a bug, and their messages name the key or file, so a
    traceback would only bury them.
    """
    try:
        yield
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def config_from_argv(argv: list[str], cls: type = Config) -> Any:
    """The validated config, or exit: 0 after --print-config/--help-config, 2 on a bad config
    or a model.name without a model."""
    with exit_on_bad_input():
        config, cli = load_config(argv, cls)
        if cli.help_config:
            print(help_text(cls))
            sys.exit(0)
        validate(config, int(os.environ.get("WORLD_SIZE", 1)))
        if cli.print_config:
            print(to_json(config))
            sys.exit(0)
        require_model_dir(config.model.name, _model_name_source(cli, config.model.name))
    return config


def require_model_dir(name: str, source: str) -> None:
    """Raise ConfigError unless `name` is a directory holding a Hugging Face config.json.

    Reads the filesystem. Checked up front because from_pretrained, given a missing directory,
    fails only after the heavy imports, with a message about the Hugging Face Hub.
    """
    if name and os.path.isfile(os.path.join(name, "config.json")):
        return
    target = shlex.quote(name) if name else "DIR"
    raise ConfigError(
        f"'model.name' = {name!r} ({source}): no Hugging Face model there (expected a directory "
        "with config.json); point it at a local model directory, or for a tiny test model (the "
        f"debug configs use one) create it with: fnt make-tiny-model --out {target}"
    )


def _model_name_source(cli: CliArgs, name: str) -> str:
    if any(key == "model.name" for key, _ in cli.overrides):
        return "command line"
    if cli.config_file is not None and name:
        return f"file {cli.config_file}"
    return "default"
