"""Configuration: frozen dataclasses, TOML + command-line loading, validation. Pure.

Precedence is CLI > TOML file > defaults. Keys are dotted paths (`optim.lr`); `-` and `_` are
the same in keys. Every problem raises `ConfigError` naming the key, where the value came from,
what was expected and, for unknown keys, the closest known key. The scripts turn that error
into exit status 2 before any model is built.

Each field has a one-line docstring right under it; `field_docs` reads them for `--help-config`
and the README.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Union

from dataclasses_json import dataclass_json

from fnt.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass_json
@dataclass(frozen=True)
class ModelConfig:
    name: str = ""
    """Local directory of a Hugging Face causal LM, loaded with from_pretrained."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the model's parameters and compute."""
    ac: bool = False
    """Activation checkpointing of every decoder layer (recompute activations in backward)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel passed to from_pretrained; both honour the packed-document mask."""


@dataclass_json
@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer algorithm."""
    lr: float = 1e-3
    """Peak learning rate (the schedule scales it per step)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1, beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    momentum: float = 0.0
    """SGD momentum."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 measures the norm without clipping."""
    impl: Literal["torch", "native", "reference"] = "torch"
    """AdamW implementation: torch's, fnt's native CPU kernel, or its pure-torch reference."""
    offload: Literal["none", "state", "full"] = "none"
    """Optimizer state with the parameters, on CPU ("state"), or full offload with CPU masters."""
    keep_fp32: tuple[str, ...] = ()
    """Parameter name substrings kept in float32 on the accelerator under full offload."""
    offload_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the compute parameters under full offload (the CPU masters stay float32)."""


@dataclass_json
@dataclass(frozen=True)
class ScheduleConfig:
    kind: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the learning rate after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr: float = 0.0
    """Learning rate reached at the last step by linear and cosine decay."""


@dataclass_json
@dataclass(frozen=True)
class DataSourceConfig:
    path: str = ""
    """Local JSONL file of prompt/completion or messages samples."""
    weight: float = 1.0
    """Relative share of this source in the mixture."""
    name: str = ""
    """Name used in metrics; empty means the file's stem."""


@dataclass_json
@dataclass(frozen=True)
class DataConfig:
    kind: Literal["synthetic", "jsonl"] = "synthetic"
    """synthetic: generated counting sequences (debugging); jsonl: the sources below."""
    sources: tuple[DataSourceConfig, ...] = ()
    """JSONL sources with weights, e.g. [{path = "train.jsonl", weight = 1.0}]."""
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    """What to do with a sample longer than seq_len."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (a pure function of seed and epoch)."""


@dataclass_json
@dataclass(frozen=True)
class CkptConfig:
    interval: int = 0
    """Save a checkpoint every this many steps; 0 saves only the final step."""
    keep_last: int = 0
    """Keep only this many newest checkpoints; 0 keeps all."""
    save_final: bool = True
    """Save the state after the last step."""


@dataclass_json
@dataclass(frozen=True)
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dimension)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2); -1 takes whatever the world size leaves."""
    cp: int = 1
    """Context parallel degree (only 1 is implemented)."""
    tp: int = 1
    """Tensor parallel degree (only 1 is implemented)."""
    ep: int | Literal["auto"] = 1
    """Expert parallel degree, or "auto" (only 1 is implemented, so auto resolves to 1)."""


@dataclass_json
@dataclass(frozen=True)
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases logging mode; offline needs no account or network."""
    project: str = "fnt"
    """W&B project name."""
    name: str = ""
    """W&B run name; empty lets W&B choose."""


@dataclass_json
@dataclass(frozen=True)
class RuntimeConfig:
    num_threads: int = 0
    """CPU threads per rank; 0 takes a fair share of the process's CPU affinity per local rank."""
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    """torch.set_float32_matmul_precision."""
    dist_timeout_s: float = 600.0
    """Timeout of collective operations, in seconds."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for perf/mfu; 0 looks it up (CUDA) or assumes 1.0 (CPU)."""


@dataclass_json
@dataclass(frozen=True)
class Config:
    output_dir: str = "runs/default"
    """Run directory: config.json, metrics.jsonl, checkpoints/."""
    seed: int = 0
    """Seed of the data order, synthetic data and sampling."""
    max_steps: int = 10
    """Optimizer steps to run; rows 1..max_steps are written."""
    batch_size: int = 8
    """Rows of seq_len tokens per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 4
    """Rows per forward/backward pass on one rank."""
    seq_len: int = 128
    """Tokens per row (documents are packed into rows)."""
    resume: int | bool | Literal["latest"] | None = None
    """None: start fresh; "latest": newest complete checkpoint if any; N: checkpoint step_N."""
    trace_path: str | None = None
    """Write a torch profiler trace per rank to trace_path/trace_{rank}.json.gz."""
    trace_steps: int = 0
    """Steps to profile from the first step; 0 profiles every step."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpointing."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel dimensions."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Process-level settings."""


# ---------------------------------------------------------------------------------------------
# Introspection


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field of a dataclass (and its bases), from source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Every leaf key of a config class as `dotted.key -> (type, docstring)`."""
    out: dict[str, tuple[Any, str]] = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            out.update(all_keys(tp, key + "."))
        else:
            out[key] = (tp, docs.get(f.name, ""))
    return out


def type_name(tp: Any) -> str:
    """A short human name of a field type, as shown in error messages and help."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return "(" + ", ".join(type_name(a) for a in args) + ")"
    if dataclasses.is_dataclass(tp):
        return "table {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


def help_text(cls: type = Config) -> str:
    """One line per key: `key (type, default): docstring`."""
    defaults = flatten(to_plain(cls()))
    lines = []
    for key, (tp, doc) in all_keys(cls).items():
        lines.append(f"--{key} ({type_name(tp)}; default {json.dumps(defaults.get(key))}): {doc}")
    return "\n".join(lines)


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


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not close:
        # A wrong last part under a right section ("optim.lrr") is the common typo.
        leaf = key.rsplit(".", 1)[-1]
        close = [
            k
            for k in known
            if k.rsplit(".", 1)[-1]
            in difflib.get_close_matches(
                leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6
            )
        ][:1]
    return f"; did you mean '{close[0]}'?" if close else ""


def _normalize_key(key: str) -> str:
    return key.replace("-", "_")


def _normalize_table(table: dict) -> dict:
    return {
        _normalize_key(k): _normalize_table(v) if isinstance(v, dict) else v
        for k, v in table.items()
    }


def _build(cls: type, values: dict, sources: dict[str, str], prefix: str = "") -> Any:
    """Construct `cls` from a nested dict of already-layered raw values."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    known = list(all_keys(cls, prefix))
    for key, raw in values.items():
        if key not in names:
            # Name the leaf the user wrote ("modl.name"), not just the unknown section.
            full = (
                prefix
                + key
                + (("." + next(iter(flatten(raw)))) if isinstance(raw, dict) and raw else "")
            )
            raise ConfigError(
                f"unknown key '{full}' ({sources.get(full, 'config')}){_suggest(full, known)}"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        key = prefix + f.name
        tp = hints[f.name]
        raw = values[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"'{key}' ({sources.get(key, 'config')}) is a section; expected a table of "
                    f"{type_name(tp)}, got {raw!r}"
                )
            kwargs[f.name] = _build(tp, raw, sources, key + ".")
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


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass(frozen=True)
class CliArgs:
    """The command line, split into its parts."""

    config_file: str | None
    overrides: tuple[tuple[str, str], ...]
    print_config: bool
    help_config: bool


def split_cli(argv: list[str], cls: type = Config) -> CliArgs:
    """Split argv into the config file, `key=value` overrides and the two info flags."""
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
        key = _normalize_key(key)
        if key in ("print_config", "help_config", "help"):
            if key == "print_config":
                print_config = True
            else:
                help_config = True
            i += 1
            continue
        if not has_value:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if leaf_types.get(key) is bool and (nxt is None or nxt.startswith("--")):
                value = "true"  # a bare boolean flag switches it on
            elif nxt is None:
                raise ConfigError(f"--{key} (command line) needs a value")
            else:
                value = nxt
                i += 1
        if key == "config":
            config_file = value
        else:
            overrides.append((key, value))
        i += 1
    return CliArgs(config_file, tuple(overrides), print_config, help_config)


def load_config(argv: list[str], cls: type = Config) -> tuple[Any, CliArgs]:
    """Resolve defaults < TOML file < CLI overrides into a frozen `cls` instance."""
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
    return config, cli


# ---------------------------------------------------------------------------------------------
# Cross-field validation


def validate(config: Config, world_size: int) -> None:  # noqa: C901 - a flat list of rules
    """Rules that involve values, several fields or the world size; raises ConfigError."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'{key}' = {_get(config, key)!r}: {message}")

    require(config.max_steps >= 1, "max_steps", "must be at least 1")
    require(config.batch_size >= 1, "batch_size", "must be at least 1")
    require(config.micro_batch_size >= 1, "micro_batch_size", "must be at least 1")
    require(config.seq_len >= 2, "seq_len", "must be at least 2")
    require(config.trace_steps >= 0, "trace_steps", "must be 0 (all steps) or more")
    require(config.optim.lr >= 0, "optim.lr", "must be >= 0")
    require(config.optim.eps > 0, "optim.eps", "must be > 0")
    require(config.optim.max_norm >= 0, "optim.max_norm", "must be >= 0 (0 measures only)")
    require(config.optim.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    require(all(0 <= b < 1 for b in config.optim.betas), "optim.betas", "each must be in [0, 1)")
    require(config.schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0")
    require(config.schedule.min_lr >= 0, "schedule.min_lr", "must be >= 0")
    require(
        config.schedule.min_lr <= config.optim.lr,
        "schedule.min_lr",
        f"must not exceed optim.lr = {config.optim.lr}",
    )
    require(config.ckpt.interval >= 0, "ckpt.interval", "must be >= 0 (0 = final step only)")
    require(config.ckpt.keep_last >= 0, "ckpt.keep_last", "must be >= 0 (0 = keep all)")
    require(config.runtime.num_threads >= 0, "runtime.num_threads", "must be >= 0 (0 = auto)")
    require(config.runtime.dist_timeout_s > 0, "runtime.dist_timeout_s", "must be > 0")
    require(config.runtime.peak_tflops >= 0, "runtime.peak_tflops", "must be >= 0 (0 = auto)")
    require(
        not isinstance(config.resume, int) or isinstance(config.resume, bool) or config.resume >= 0,
        "resume",
        'must be a step number >= 0, "latest", true/false or none',
    )
    if config.data.kind == "jsonl":
        require(
            bool(config.data.sources),
            "data.sources",
            'data.kind = "jsonl" needs at least one source',
        )
        for i, source in enumerate(config.data.sources):
            if not source.path:
                raise ConfigError(f"'data.sources[{i}].path' is empty: name a JSONL file")
            if source.weight <= 0:
                raise ConfigError(f"'data.sources[{i}].weight' = {source.weight}: must be > 0")
        names = [source_name(s) for s in config.data.sources]
        require(
            len(set(names)) == len(names), "data.sources", f"source names must differ, got {names}"
        )
    dp = data_parallel_size(config.parallel, world_size)
    rows_per_pass = config.micro_batch_size * dp
    require(
        config.batch_size % rows_per_pass == 0,
        "batch_size",
        f"must be divisible by micro_batch_size ({config.micro_batch_size}) x data-parallel size "
        f"({dp}) = {rows_per_pass}",
    )
    if isinstance(config, RLConfig):
        require(config.rollout.timeout_s > 0, "rollout.timeout_s", "must be > 0")
        require(config.rollout.keep_weights >= 1, "rollout.keep_weights", "must be at least 1")
        require(config.loss.eps_low >= 0, "loss.eps_low", "must be >= 0")
        require(config.loss.eps_high >= 0, "loss.eps_high", "must be >= 0")
        require(config.loss.kl_tau >= 0, "loss.kl_tau", "must be >= 0")
        if config.rollout.engine == "in_process":
            validate_rollout(config.rollout, dp_size=dp)


def validate_rollout(rollout: RolloutConfig, *, dp_size: int) -> None:
    """ConfigError unless the in-process engine's settings can run on dp_size ranks. Pure."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'rollout.{key}' = {getattr(rollout, key)!r}: {message}")

    require(bool(rollout.prompts), "prompts", "name a JSONL file of prompts")
    require(bool(rollout.reward), "reward", 'name a reward (see fnt.rewards) or "module:function"')
    require(rollout.prompts_per_step >= 1, "prompts_per_step", "must be at least 1")
    require(
        rollout.prompts_per_step % dp_size == 0,
        "prompts_per_step",
        f"must be divisible by the data-parallel size ({dp_size}): each rank takes an equal share",
    )
    require(rollout.group_size >= 1, "group_size", "must be at least 1")
    require(rollout.max_new_tokens >= 1, "max_new_tokens", "must be at least 1")
    require(
        math.isfinite(rollout.temperature) and rollout.temperature > 0,
        "temperature",
        "must be a finite number > 0",
    )


def source_name(source: DataSourceConfig) -> str:
    """A source's metric name: its `name`, else the file's stem."""
    return source.name or os.path.splitext(os.path.basename(source.path))[0]


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """dp_replicate x dp_shard once -1 is filled in from the world size."""
    others = parallel.cp * parallel.tp
    if parallel.dp_shard == -1:
        return max(1, world_size // max(1, others))
    return parallel.dp_replicate * parallel.dp_shard


def _get(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


# ---------------------------------------------------------------------------------------------
# Serialization


def to_plain(config: Any) -> dict:
    """A JSON-ready nested dict (tuples become lists)."""
    return json.loads(config.to_json())


def to_json(config: Any) -> str:
    return json.dumps(to_plain(config), indent=2, sort_keys=True)


def from_json(cls: type, text: str) -> Any:
    """Inverse of `to_json`, validated through the same builder as TOML input."""
    table = json.loads(text)
    sources = {k: "json" for k in flatten(table)}
    return _build(cls, table, sources)


# ---------------------------------------------------------------------------------------------
# RL


@dataclass_json
@dataclass(frozen=True)
class RLLossConfig:
    eps_low: float = 0.2
    """Mask tokens with A < 0 whose importance ratio is already below 1 - eps_low."""
    eps_high: float = 0.28
    """Mask tokens with A > 0 whose importance ratio is already above 1 + eps_high."""
    kl_tau: float = 0.0
    """Weight of the penalty kl_tau * (log r)^2; 0 turns it off."""


@dataclass_json
@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["in_process", "external"] = "in_process"
    """in_process: generate with the current policy here; external: read {output_dir}/rollouts/."""
    prompts: str = ""
    """JSONL file of prompts: {"prompt": ...} or {"messages": [...]}, plus fields for the reward."""
    prompts_per_step: int = 4
    """Prompts sampled per optimizer step, over all data-parallel ranks."""
    group_size: int = 4
    """Completions generated per prompt (advantages are relative within the group)."""
    max_new_tokens: int = 32
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    reward: str = ""
    """Reward function: a registry name (see fnt.rewards) or "module:function"."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (plus eps)."""
    timeout_s: float = 600.0
    """External engine: how long to wait for a step's rollouts."""
    keep_weights: int = 2
    """External engine: published weight directories to keep."""


@dataclass_json
@dataclass(frozen=True)
class RLConfig(Config):
    loss: RLLossConfig = field(default_factory=RLLossConfig)
    """The policy-gradient loss."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout generation and rewards."""


def markdown_keys(cls: type = RLConfig) -> str:
    """A Markdown table of every key of `cls` (type, default, description), for the README."""
    defaults = flatten(to_plain(cls()))
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, (tp, doc) in all_keys(cls).items():
        kind = type_name(tp).replace("|", "\\|")
        lines.append(f"| `{key}` | {kind} | `{json.dumps(defaults.get(key))}` | {doc} |")
    return "\n".join(lines)
