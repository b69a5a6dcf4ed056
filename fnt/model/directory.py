"""What makes a directory a Hugging Face model fnt can load, checked without importing torch or
transformers. Side effects: reads the directory's config.json, its weights' index and tokenizer
JSON files, and the source of transformers' table of causal language models (not imported).

`model_dir_problem` answers with the reason a directory cannot be loaded, or None; preflight
(fnt.apps.preflight.require_model_dir) turns that into one `error:` line naming the key, before
transformers is called and before anything of the run is written. Without these checks a
truncated config.json or a missing shard is a long transformers traceback after the heavy imports.
"""

from __future__ import annotations

import ast
import json
import os
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

CONFIG_FILE = "config.json"
# The weight files transformers' from_pretrained reads, and the indexes of sharded ones.
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Tokenizer files that are JSON: a truncated one fails inside the tokenizer library.
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json")


def model_dir_problem(path: str) -> Optional[str]:
    """Why the directory at `path` is not a Hugging Face causal LM that from_pretrained can load
    (`config_problem`, `weights_problem`), or None. Reads only."""
    return config_problem(path) or weights_problem(path)


def read_json_file(path: Path) -> tuple[object, Optional[str]]:
    """(the parsed JSON of `path`, None), or (None, why it cannot be read or parsed)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return None, f"{path.name} cannot be read ({reason})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        # An object or array that does not end with its closing bracket was cut short.
        hint = " (truncated?)" if not text.rstrip().endswith(("}", "]")) else ""
        return None, f"{path.name} is not valid JSON{hint}: {exc}"


def config_problem(path: str) -> Optional[str]:
    """Why config.json of the model directory `path` cannot configure a causal LM: missing,
    unreadable, not JSON (a truncated download), not an object, without a model_type, or with a
    model_type that the installed transformers has no causal LM class for. None when it can."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return f"no {CONFIG_FILE} there (expected a Hugging Face model directory)"
    config, problem = read_json_file(file)
    if problem:
        return f"{problem}; fetch the model's files again"
    if not isinstance(config, dict):
        return f"{CONFIG_FILE} holds {type(config).__name__}, not a JSON object"
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    named = f" (architectures {architectures})" if architectures else ""
    if not isinstance(model_type, str) or not model_type:
        return (
            f"{CONFIG_FILE} names no model_type{named}, which transformers needs to choose the "
            "model class"
        )
    known = causal_lm_model_types()
    if known is not None and model_type not in known:
        version = transformers_version()
        return (
            f"{CONFIG_FILE} has model_type {model_type!r}{named}, for which transformers "
            f"{version} has no causal language model class; a newer transformers may have it "
            "(pip install -U transformers), and fnt trains causal LMs only"
        )
    return None


def weights_problem(path: str) -> Optional[str]:
    """Why the model directory `path` has no complete weights: no *.safetensors or
    pytorch_model*.bin file, or an index (model.safetensors.index.json) that is not JSON or
    names shard files that are not there. None when they are complete."""
    directory = Path(path)
    for index_name in WEIGHT_INDEXES:
        index_file = directory / index_name
        if not index_file.is_file():
            continue
        index, problem = read_json_file(index_file)
        if problem:
            return f"{problem}; fetch the model's files again"
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            return f"{index_name} has no weight_map object"
        missing = sorted({str(s) for s in weight_map.values()} - set(os.listdir(directory)))
        if missing:
            shown = ", ".join(missing[:3]) + (
                f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            )
            return (
                f"{index_name} names {len(missing)} weight file(s) that are not there ({shown}); "
                "the download is incomplete: fetch the model's files again"
            )
        return None
    names = os.listdir(directory)
    if any(
        name.endswith(".safetensors")
        or (name.startswith("pytorch_model") and name.endswith(".bin"))
        for name in names
    ):
        return None
    return "no weights there (no *.safetensors or pytorch_model*.bin file)"


def tokenizer_problem(path: str) -> Optional[str]:
    """Why the tokenizer JSON files of the model directory `path` (tokenizer_config.json,
    tokenizer.json, those present) cannot be read, or None."""
    for name in TOKENIZER_JSON_FILES:
        file = Path(path) / name
        if file.is_file():
            data, problem = read_json_file(file)
            if problem:
                return f"{problem}; fetch the model's files again"
            if not isinstance(data, dict):
                return f"{name} holds {type(data).__name__}, not a JSON object"
    return None


@cache
def causal_lm_model_types() -> Optional[frozenset[str]]:
    """The model_types transformers' AutoModelForCausalLM can build, read from the source of its
    table (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES in transformers/models/auto/modeling_auto.py)
    without importing transformers, which imports torch and costs seconds; None when the table
    cannot be read there (the check is then left to from_pretrained)."""
    spec = find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        source = Path(location) / "models" / "auto" / "modeling_auto.py"
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(
                    isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                    for t in node.targets
                )
                and isinstance(node.value, ast.Call)
                and node.value.args
            ):
                try:
                    pairs = ast.literal_eval(node.value.args[0])
                except ValueError:
                    return None
                return frozenset(pair[0] for pair in pairs)
    return None


def transformers_version() -> str:
    """The installed transformers' version, from its metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "(not installed)"
