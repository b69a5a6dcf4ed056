"""Command-line front end shared by the `fnt` commands. Side effects: prints, exits, reads
the launcher's environment ($RANK, $WORLD_SIZE) and, under torchrun, writes the error line into
$TORCHELASTIC_ERROR_FILE; parsing reads the TOML file, validation imports the modules a
config names (fnt.config), and the Hub ids a config names are resolved in huggingface_hub's cache,
downloaded there when missing (fnt.apps.hub_models).

Parsing and validation happen before fnt imports torch or transformers (a module the config
names for monitors, loss.custom or dpo.custom may import them itself), so a bad command line
exits with status 2 within about a second.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fnt.config import (
    CliArgs,
    Config,
    DPOConfig,
    RLConfig,
    help_text,
    load_config,
    to_json,
    validate,
)
from fnt.errors import CheckpointError, ConfigError, DataError, ServerError, UserCodeError

EXIT_BAD_INPUT = 2
EXIT_SERVER_FAILED = 3


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Turn a ConfigError, DataError, CheckpointError or UserCodeError (the user's own reward or
    environment failed) into `error: <message>` on stderr and exit status 2; a ServerError (an
    inference server down after the retries) likewise into status 3.

    They are the user's input (or disk), not a bug, and their messages name the key or file, so a
    traceback would only bury them. Under torchrun every rank meets the same bad input, and
    only rank 0 prints it; every rank also leaves it in torchrun's error file, so that the
    failure report torchrun prints next ends with the `error:` line instead of a pointer to
    its docs (`report_to_launcher`).
    """
    try:
        yield
    except (ConfigError, DataError, CheckpointError, UserCodeError) as exc:
        exit_with(exc, EXIT_BAD_INPUT)
    except ServerError as exc:  # not the input's fault, but as plain to say
        exit_with(exc, EXIT_SERVER_FAILED)


# How long a rank other than 0 waits before it exits on a bad input. torchrun stops every worker
# as soon as one fails, so a rank 1 that exited first could kill rank 0 before rank 0 printed
# the line; rank 0 meets the same input within this time and its exit ends the wait.
OTHER_RANKS_EXIT_DELAY_S = 10.0


def exit_with(exc: Exception, status: int) -> None:
    """Print `error: <exc>` (rank 0), leave it in torchrun's error file, exit with `status`."""
    report_to_launcher(f"error: {exc}")
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {exc}", file=sys.stderr)
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(OTHER_RANKS_EXIT_DELAY_S)
    sys.exit(status)


def report_to_launcher(message: str) -> None:
    """Under torchrun, write `message` into the worker's error file (TORCHELASTIC_ERROR_FILE),
    whose message torchrun's failure report shows as the worker's `traceback`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"message": message, "timestamp": int(time.time())}, fh)
    except OSError:  # the report is a courtesy; the exit status says what happened
        pass


def parse_config(argv: list[str], cls: type = Config) -> tuple[Any, str]:
    """The validated config and where its model.name came from, or exit: 0 after
    --print-config/--help-config, 2 on a bad config."""
    with exit_on_bad_input():
        config, cli = load_config(argv, cls)
        if cli.help_config:
            print(help_header(cls))
            print(help_text(cls))
            sys.exit(0)
        validate(config, int(os.environ.get("WORLD_SIZE", 1)))
        if cli.print_config:
            print(to_json(config))
            sys.exit(0)
        source = model_name_source(cli, config.model.name)
        from fnt.apps.hub_models import resolve_hub_models

        config = resolve_hub_models(config, source)  # Hub ids to snapshot directories
    return config, source


def help_header(cls: type) -> str:
    """The usage lines above the key list of `fnt sft --help` / `fnt rl --help`. Pure."""
    command, extra = "fnt sft", ""
    if issubclass(cls, RLConfig):
        command = "fnt rl"
        extra = "       fnt rl --list-environments   (what rollout.environment can name)\n"
    elif issubclass(cls, DPOConfig):
        command = "fnt dpo"
    return f"""\
usage: {command} [--config FILE.toml] [--KEY VALUE | --KEY=VALUE]... [--print-config] [-h]
{extra}
  --config FILE.toml  read keys from a TOML file; the command line overrides them
  --print-config      print the resolved config as JSON and exit
  -h, --help, --help-config
                      print this list and exit

Every config key is an option (`--optim.lr 1e-4`; `-` or `_` alike; a bare boolean key sets
it to true). A name from TRL or transformers (`--learning_rate`) is answered with fnt's key.
Keys:
"""


def model_name_source(cli: CliArgs, name: str) -> str:
    """Where `model.name` came from, for its error message: the command line, the file or the
    default."""
    if any(key == "model.name" for key, _ in cli.overrides):
        return "command line"
    if cli.config_file is not None and name:
        return f"file {cli.config_file}"
    return "default"
