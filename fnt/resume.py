"""Which checkpoint to resume from. Pure, apart from listing one directory.

A checkpoint directory is complete when it is named `step_N` and holds the marker file
`COMPLETE`. The saver writes everything into a temporary sibling, writes the marker last and
only then renames the directory to `step_N` (fnt.transaction), so a crash at any moment
leaves either a complete `step_N` or something these rules ignore. `abandoned/`, where a
resumed run moves the checkpoints of the trajectory it leaves (`abandoned_names`), is one of
those.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Optional, Union

from fnt.errors import ConfigError
from fnt.transaction import COMPLETE_MARKER, PARTIAL_SUFFIX

# Only the canonical names the saver writes: no leading zeros, ASCII digits, nothing after.
_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]*)")
ABANDONED_DIR = "abandoned"


class ResumeError(ConfigError):
    """The requested checkpoint does not exist or is incomplete (a bad `resume` value)."""


def step_of(name: str) -> Optional[int]:
    """N for a directory name `step_N`, else None."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoint_dir(ckpt_root: Union[str, Path], step: int) -> Path:
    return Path(ckpt_root) / f"step_{step}"


def complete_steps(entries: Iterable[tuple[str, bool]]) -> list[int]:
    """Sorted steps of the complete checkpoints in a listing of `(name, has_marker)`. Pure."""
    return sorted(
        step for name, has_marker in entries if has_marker and (step := step_of(name)) is not None
    )


def abandoned_names(entries: Iterable[tuple[str, bool]], start_step: int) -> list[str]:
    """The entries of a listing of `(name, has_marker)` that a run starting at `start_step` moves
    aside: complete checkpoints newer than the start (another trajectory: resuming would collide
    with them, keep_last would count them as the newest, and "latest" would pick them later) and
    every `step_M.partial` (a save that never finished). Pure."""
    return sorted(
        name
        for name, has_marker in entries
        if (has_marker and (step := step_of(name)) is not None and step > start_step)
        or (name.endswith(PARTIAL_SUFFIX) and step_of(name[: -len(PARTIAL_SUFFIX)]) is not None)
    )


def choose_resume_step(resume: Union[int, bool, str, None], steps: list[int]) -> Optional[int]:
    """The resume decision over the complete steps found. Pure.

    None/False -> None (start fresh); "latest"/True -> the highest step, or None when there is
    none; an int N -> N if step_N is complete, else ResumeError listing what exists.
    """
    if resume is None or resume is False:
        return None
    if resume is True or resume == "latest":
        return max(steps) if steps else None
    if isinstance(resume, int):
        if resume in steps:
            return resume
        found = ", ".join(str(s) for s in steps) if steps else "none"
        raise ResumeError(
            f"resume = {resume}: no complete checkpoint step_{resume}; "
            f"complete steps found: {found}"
        )
    raise ResumeError(f'resume = {resume!r}: expected none, "latest", true/false or a step number')


def list_checkpoints(ckpt_root: Union[str, Path]) -> list[tuple[str, bool]]:
    """`(name, has_marker)` for each directory entry of ckpt_root; empty if it does not exist."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return [
        (entry.name, entry.is_dir() and os.path.isfile(os.path.join(entry.path, COMPLETE_MARKER)))
        for entry in os.scandir(root)
    ]


def resolve_resume_step(
    resume: Union[int, bool, str, None], ckpt_dir: Union[str, Path]
) -> Optional[int]:
    """The step to resume from given the `resume` setting and the checkpoint directory."""
    return choose_resume_step(resume, complete_steps(list_checkpoints(ckpt_dir)))
