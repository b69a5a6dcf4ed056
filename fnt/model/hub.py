"""Hugging Face Hub ids where a model is named: `Qwen/Qwen2.5-0.5B` is resolved to its snapshot
directory in huggingface_hub's cache, downloaded there first when it is missing. Side effects:
`hub_snapshot` reads the cache, may download into it (the network, unless HF_HUB_OFFLINE), and
under torchrun writes and reads a small file in the cache that tells a node's other ranks which
snapshot its local rank 0 resolved; it prints nothing.

A name is a Hub id when it is not a path that exists and looks like one (`org/name`: one slash,
no leading `.`, `/` or `~`); anything else stays a local directory and gets the local checks.
The cache is huggingface_hub's own (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN as it
reads them), so a model downloaded once by transformers, `hf download` or vLLM is found again.
Under torchrun each node downloads once: local rank 0 resolves and downloads, the node's other
ranks wait for its answer and then take that commit from the cache with local_files_only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Optional

from fnt.errors import ConfigError, named

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
# What a causal LM's snapshot needs: config, safetensors weights and their index, tokenizer and
# chat template files; not the duplicate formats (pytorch_model.bin, onnx, gguf) many repos add.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
MARKERS_DIR = ".fnt-resolved"
MARKER_POLL_S = 0.2
MARKER_MAX_AGE_S = 24 * 3600


def is_hub_id(name: str) -> bool:
    """Whether `name` means a Hub repository: no such local path, and `org/name` in form."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not os.path.lexists(name)


def repo_folder(repo_id: str) -> str:
    """The cache folder name huggingface_hub gives a model repository: `models--org--name`."""
    return "models--" + repo_id.replace("/", "--")


def is_snapshot_of(path: str, repo_id: str) -> bool:
    """Whether `path` is a snapshot directory of `repo_id` in a huggingface_hub cache
    (…/models--org--name/snapshots/<commit>) that is still there."""
    parts = Path(path).parts
    return (
        len(parts) >= 3
        and parts[-3] == repo_folder(repo_id)
        and parts[-2] == "snapshots"
        and os.path.isdir(path)
    )


def hub_snapshot(
    repo_id: str, revision: Optional[str] = None, key: str = "model.name", source: str = ""
) -> str:
    """The snapshot directory of `repo_id` at `revision` (None: the default branch) in the cache,
    downloaded into it when missing; once per node under torchrun. A ConfigError naming `key`
    (from `source`) when it cannot be had: not in the cache while HF_HUB_OFFLINE is set or the
    Hub cannot be reached, no such repository or revision, a gated one without access."""
    from huggingface_hub import constants, snapshot_download

    def resolve(local_files_only: bool, commit: Optional[str] = None) -> str:
        # Offline, ask for the cache alone: huggingface_hub 1.x, given a commit hash and
        # local_files_only=False, skips its cache look-up and lists the repository's files on
        # the Hub (refused offline) unless it listed them itself before, so a snapshot laid out
        # by another tool or version was "not in the cache".
        return snapshot_download(
            repo_id,
            revision=commit or revision,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=local_files_only or bool(constants.HF_HUB_OFFLINE),
        )

    try:
        return once_per_node(resolve, repo_id, revision, Path(constants.HF_HUB_CACHE))
    except (OSError, ValueError) as exc:
        came_from = f" ({source})" if source else ""
        at = f" at revision {revision!r}" if revision else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = " and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{named(key, repo_id)}{came_from}: not a local directory, and as a Hugging Face Hub "
            f"id{at} it cannot be had: it is not in the cache {constants.HF_HUB_CACHE}{offline} "
            f"({type(exc).__name__}: {first}). Download it where the Hub is reachable (hf "
            f"download {repo_id}, with HF_HOME the same), or point {key} at a local model "
            f"directory; if {repo_id!r} was meant as one, there is none at that path (a tiny "
            f"test model, as the debug configs use: fnt make-tiny-model --out {repo_id})"
        ) from None


def once_per_node(resolve, repo_id: str, revision: Optional[str], cache: Path) -> str:
    """`resolve(local_files_only=False)` in this process, except under torchrun with several
    ranks on the node: local rank 0 resolves (and downloads) and leaves the commit it got in a
    marker file of the cache; the other local ranks wait for that file, then resolve that commit
    with local_files_only, so the node downloads once and every rank loads the same files."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    if local_world <= 1 or not launch:
        return resolve(local_files_only=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    digest = hashlib.sha256(f"{launch}|{restart}|{repo_id}|{revision}".encode()).hexdigest()[:32]
    marker = cache / MARKERS_DIR / f"{digest}.json"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        path = resolve(local_files_only=False)
        write_marker_(marker, Path(path).name)
        return path
    # torchrun stops this rank if local rank 0 fails, so waiting needs no deadline of its own.
    while not marker.is_file():
        time.sleep(MARKER_POLL_S)
    commit = json.loads(marker.read_text())["commit"]
    return resolve(local_files_only=True, commit=commit)


def write_marker_(marker: Path, commit: str) -> None:
    """Write `marker` whole (a temporary file renamed into place), and remove markers older
    than a day: each launch writes its own."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in marker.parent.glob("*.json"):
        try:
            if now - old.stat().st_mtime > MARKER_MAX_AGE_S:
                old.unlink()
        except OSError:  # another node's rank 0 removed it first
            pass
    partial = marker.with_name(f"{marker.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"commit": commit}))
    os.replace(partial, marker)
