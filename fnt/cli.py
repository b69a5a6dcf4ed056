"""Command-line front end shared by the scripts. Side effects: prints, exits.

Parsing and validation happen before torch or transformers are imported, so a bad command
line exits with status 2 within about a second.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fnt.config import Config, ConfigError, help_text, load_config, to_json, validate

EXIT_BAD_CONFIG = 2


def config_from_argv(argv: list[str], cls: type = Config) -> Any:
    """The validated config, or exit: 0 after --print-config/--help-config, 2 on a bad config."""
    try:
        config, cli = load_config(argv, cls)
        if cli.help_config:
            print(help_text(cls))
            sys.exit(0)
        validate(config, int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    if cli.print_config:
        print(to_json(config))
        sys.exit(0)
    return config


def exit_on_config_error(exc: ConfigError) -> None:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)
