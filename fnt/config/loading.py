"""Building a config from raw values: defaults < TOML file < command line, and from JSON.
Side effects: `load_config` reads the TOML file named by `--config`; a deprecated spelling of a
value prints a warning to stderr (on rank 0: $RANK); the keys come from the schema's source
(fnt.config.schema.field_docs). Everything else here is pure.

Precedence is CLI > TOML file > defaults. Keys are dotted paths (`optim.lr`); `-` and `_` are
the same in keys. Every problem raises `ConfigError` naming the key, where the value came from,
what was expected and, for unknown keys, the closest known key. The scripts turn that error
into exit status 2 before any model is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from fnt.config.aliases import suggest
from fnt.config.schema import Config, all_keys, field_types, flatten, type_name
from fnt.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# ---------------------------------------------------------------------------------------------
# Coercion of raw values (TOML values or CLI strings) to field types


class _Mismatch(Exception):
    pass


_NONE_WORDS = {"none", "null"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


def _coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    origin = typing.get_origin(tp)
    if tp is type(None):
        if value is None or (from_cli and isinstance(value, str) and value.lower() in _NONE_WORDS):
            return None
        raise _Mismatch
    if origin in (Union, types.UnionType):
        # Try the narrow members first so "3" becomes 3, not "3", and "true" a bool.
        members = sorted(typing.get_args(tp), key=_union_rank)
        for member in members:
            try:
                return _coerce(value, member, from_cli)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            if value.lower() in _TRUE_WORDS:
                return True
            if value.lower() in _FALSE_WORDS:
                return False
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin is tuple:
        if from_cli and isinstance(value, str):
            value = _parse_cli_list(value)
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], from_cli) for v in value)
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_coerce(v, a, from_cli) for v, a in zip(value, args))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return value  # a nested table inside a list; built by _build with its own key path
    raise TypeError(f"unsupported config type {tp!r}")


def _union_rank(member: Any) -> int:
    # int before bool: on the command line "1" is a step number, not true.
    order = [type(None), int, bool, float]
    return order.index(member) if member in order else len(order)


def _parse_cli_list(text: str) -> Any:
    """`[..]` is JSON (needed for lists of tables); anything else is a comma-separated list."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            raise _Mismatch from None
    return [] if not stripped else [part.strip() for part in stripped.split(",")]


# ---------------------------------------------------------------------------------------------
# Building a config from layered sources


def _suggest(key: str, known: list[str], value: object) -> str:
    """The did-you-mean of an unknown key given `value` (fnt.config.aliases.suggest: TRL's and
    transformers' names first, a switch written off answered with its off value, then the
    nearest key by edit distance within its section)."""
    return suggest(key, known, value)


def _normalize_key(key: str) -> str:
    return key.replace("-", "_")


def _normalize_table(table: dict) -> dict:
    return {
        _normalize_key(k): _normalize_table(v) if isinstance(v, dict) else v
        for k, v in table.items()
    }


def _build(
    cls: type,
    values: dict,
    sources: dict[str, str],
    prefix: str = "",
    every_key: list[str] | None = None,
) -> Any:
    """Construct `cls` from a nested dict of already-layered raw values. `every_key`: the keys
    of the whole config, which an unknown key's suggestion is chosen from (default: cls's)."""
    hints = field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    known = every_key if every_key is not None else list(all_keys(cls, prefix))
    for key, raw in values.items():
        if key not in names:
            # Name the leaf the user wrote ("modl.name"), not just the unknown section.
            full = (
                prefix
                + key
                + (("." + next(iter(flatten(raw)))) if isinstance(raw, dict) and raw else "")
            )
            raise ConfigError(
                f"unknown key '{full}' ({sources.get(full, 'config')}){_suggest(full, known, raw)}"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        key = prefix + f.name
        tp = hints[f.name]
        raw = values[f.name]
        if canonical_value(key, raw) != raw:
            source = sources.get(key, "config")
            if source != "json" and os.environ.get("RANK", "0") == "0":
                print(
                    f"warning: '{key}' = {json.dumps(raw)} ({source}) is deprecated: it is now "
                    f"spelled {json.dumps(canonical_value(key, raw))}, which means the same",
                    file=sys.stderr,
                )
            raw = canonical_value(key, raw)
        if dataclasses.is_dataclass(tp):
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"'{key}' ({sources.get(key, 'config')}) is a section; expected a table of "
                    f"{type_name(tp)}, got {raw!r}"
                )
            kwargs[f.name] = _build(tp, raw, sources, key + ".", known)
            continue
        try:
            value = _coerce(raw, tp, sources.get(key, "").startswith("command line"))
        except _Mismatch:
            raise ConfigError(
                f"'{key}' ({sources.get(key, 'config')}): expected {type_name(tp)}, got {raw!r}"
            ) from None
        kwargs[f.name] = _build_nested_items(tp, value, sources, key)
    return cls(**kwargs)


def _build_nested_items(tp: Any, value: Any, sources: dict[str, str], key: str) -> Any:
    """Turn the tables inside a `tuple[SomeConfig, ...]` value into dataclass instances."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
        item_cls = args[0]
        source = sources.get(key, "config")
        items = []
        for i, item in enumerate(value):
            item_sources = {f"{key}[{i}].{k}": source for k in item}
            items.append(_build(item_cls, _normalize_table(item), item_sources, f"{key}[{i}]."))
        return tuple(items)
    return value


def _set_nested(target: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{dotted}' goes inside '{part}', which is not a section")
        node = child
    node[parts[-1]] = value


# Command-line spellings of keys whose TOML name cannot have them: `resume` is a value, so it
# cannot also be the section of `resume.force`.
_ALIASES = {"resume.force": "resume_force"}

# Old values that still work, by key: old value -> its current name.
VALUE_ALIASES: dict[str, dict[Any, Any]] = {"data.kind": {"jsonl": "sources"}}


def canonical_value(key: str, value: Any) -> Any:
    """The current spelling of `value` for `key` (an old one in VALUE_ALIASES is renamed)."""
    try:
        return VALUE_ALIASES.get(key, {}).get(value, value)
    except TypeError:  # an unhashable value (a list) is no alias
        return value


HELP_FLAGS = ("-h", "--help", "--help-config", "--help_config")
"""The options that print the key list and exit, whatever else the command line holds."""


@dataclass(frozen=True)
class CliArgs:
    """The command line, split into its parts."""

    config_file: str | None
    overrides: tuple[tuple[str, str], ...]
    print_config: bool
    help_config: bool


def split_cli(argv: list[str], cls: type = Config) -> CliArgs:
    """Split argv into the config file, `key=value` overrides and the two info flags
    (`--print-config`; `--help`, `-h` or `--help-config`). `--key value` and `--key=value` are
    the same; a key followed by another option or by nothing is a bare flag (true) when it may
    be a boolean or is unknown, and otherwise needs a value."""
    if any(arg in HELP_FLAGS for arg in argv):  # help wins over everything else, as argparse's
        return CliArgs(None, (), False, True)
    leaf_types = {k: tp for k, (tp, _) in all_keys(cls).items()}
    config_file = None
    overrides: list[tuple[str, str]] = []
    print_config = help_config = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument '{arg}' (command line); options look like --key=value"
            )
        body = arg[2:]
        key, has_value, value = body.partition("=")
        key = _ALIASES.get(_normalize_key(key), _normalize_key(key))
        if key in ("print_config", "help_config", "help"):
            if key == "print_config":
                print_config = True
            else:
                help_config = True
            i += 1
            continue
        if not has_value:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value = nxt
                i += 1
            elif key != "config" and (key not in leaf_types or _takes_bool(leaf_types[key])):
                # A bare flag is true: a boolean key (or one that may be a boolean, such as
                # model.compile), and a key fnt does not have (`--bf16`), which is then answered
                # as an unknown key, not with the next option taken as its value.
                value = "true"
            else:
                raise ConfigError(f"--{key} (command line) needs a value")
        if key == "config":
            config_file = value
        else:
            overrides.append((key, value))
        i += 1
    return CliArgs(config_file, tuple(overrides), print_config, help_config)


def _takes_bool(tp: Any) -> bool:
    """Whether a key of type `tp` takes true or false (bool, or a union with bool in it)."""
    if tp is bool:
        return True
    return typing.get_origin(tp) in (Union, types.UnionType) and bool in typing.get_args(tp)


def load_config(argv: list[str], cls: type = Config) -> tuple[Any, CliArgs]:
    """Resolve defaults < TOML file < CLI overrides into a frozen `cls` instance.

    Reads the TOML file named by `--config`, if any; a missing, unreadable or malformed file is a
    ConfigError.
    """
    cli = split_cli(argv, cls)
    values: dict = {}
    sources: dict[str, str] = {}
    if cli.config_file is not None:
        path = cli.config_file
        try:
            with open(path, "rb") as fh:
                table = _normalize_table(tomllib.load(fh))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as exc:  # a directory, or a file this user cannot read
            raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for key in flatten(table):
            sources[key] = f"file {path}"
        values = table
    for key, raw in cli.overrides:
        _set_nested(values, key, raw)
        sources[key] = "command line"
        # A list of tables given on the command line replaces the file's whole list.
        for k in [k for k in sources if k.startswith(key + ".")]:
            sources[k] = "command line"
    config = _build(cls, values, sources)
    config = settle_steps_and_epochs(config, sources)
    return config, cli


def settle_steps_and_epochs(config: Any, sources: dict[str, str]) -> Any:
    """max_steps and max_epochs (> 0) both set the run's length. Given in one place (both in
    the file, or both on the command line) they are a ConfigError; given in two, the command
    line's wins over the file's, as for any key: `--max_steps N` turns the file's max_epochs
    off, `--max_epochs E` overrides the file's max_steps."""
    steps_from, epochs_from = sources.get("max_steps"), sources.get("max_epochs")
    if not (getattr(config, "max_epochs", 0) > 0 and steps_from):
        return config
    if steps_from == epochs_from:
        raise ConfigError(
            f"'max_steps' = {config.max_steps} and 'max_epochs' = {config.max_epochs} "
            f"({steps_from}) both set the run's length: give one (max_epochs is resolved to a "
            "step count at the start)"
        )
    if steps_from == "command line":
        return dataclasses.replace(config, max_epochs=0.0)
    return config


def from_json(cls: type, text: str) -> Any:
    """Inverse of `to_json`, validated through the same builder as TOML input."""
    table = json.loads(text)
    sources = {k: "json" for k in flatten(table)}
    return _build(cls, table, sources)
