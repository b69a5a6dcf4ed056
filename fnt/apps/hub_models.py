"""The models a command's config names, with Hub ids resolved to snapshot directories
(fnt.model.hub) before any check reads them. Side effects: those of fnt.model.hub.hub_snapshot
(the cache, a download), and reading the config.json of the checkpoint a resume starts from.

`model.name` (at `model.revision`) and the reference key of the config's mode (`loss.ref_model`,
`dpo.ref_model`) may be Hub ids. The resolved config names the snapshot directories, so the
run's config.json and checkpoints record exactly which files it trained from; a resume that
names the same id (and revision) uses the snapshot its checkpoint recorded, even when the
branch has moved on since, so it continues on the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from fnt.config import Config, ConfigError, mode_of
from fnt.config.modes import value_at
from fnt.model.hub import hub_snapshot, is_hub_id, is_snapshot_of
from fnt.resume import resolve_resume_step
from fnt.store.rundir import CONFIG_FILE, ckpt_root, step_dir


def resolve_hub_models(config: Config, model_name_source: str = "") -> Config:
    """`config` with each model key that holds a Hub id (`model_keys`) set to its snapshot
    directory: the one the resumed checkpoint recorded (`recorded_snapshot`), else the cache's,
    downloaded when missing. A ConfigError naming the key when an id cannot be had."""
    recorded = resumed_config(config)
    for key, revision in model_keys(config):
        name = value_at(config, key)
        if not is_hub_id(name):
            continue
        path = recorded_snapshot(recorded, key, name, revision)
        if path is None:
            source = model_name_source if key == "model.name" else ""
            path = hub_snapshot(name, revision or None, key, source)
        config = with_value(config, key, path)
    return config


def model_keys(config: Config) -> list[tuple[str, str]]:
    """(key, revision) of each key of `config` that names a model: model.name at model.revision,
    and its mode's reference key (at the default branch). Pure."""
    keys = [("model.name", config.model.revision)]
    reference = mode_of(config).reference_key
    if reference:
        keys.append((reference, ""))
    return keys


def resumed_config(config: Config) -> Optional[dict]:
    """The config.json of the checkpoint `config.resume` starts from, as a dict; None for a
    fresh start, or when it cannot be read (the start-up checks report that)."""
    try:
        step = resolve_resume_step(config.resume, ckpt_root(config.output_dir))
    except ConfigError:
        return None
    if step is None:
        return None
    try:
        saved = json.loads((step_dir(ckpt_root(config.output_dir), step) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def recorded_snapshot(
    recorded: Optional[dict], key: str, repo_id: str, revision: str
) -> Optional[str]:
    """The snapshot directory of `repo_id` that the resumed checkpoint's config (`recorded`)
    holds at `key`, when it was resolved at the same revision and is still there; else None."""
    if recorded is None:
        return None
    path: Any = recorded
    for part in key.split("."):
        path = path.get(part) if isinstance(path, dict) else None
    same_revision = key != "model.name" or (recorded.get("model") or {}).get("revision", "") == (
        revision
    )
    if isinstance(path, str) and same_revision and is_snapshot_of(path, repo_id):
        return path
    return None


def with_value(config: Any, key: str, value: Any) -> Any:
    """`config` (a frozen dataclass) with the dotted `key` set to `value`. Pure."""
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: with_value(getattr(config, head), rest, value)})
