"""Regenerate the generated tables of README.md (writes README.md): the config keys, from the
config dataclasses, the resume policy, from `fnt.resume.RESUME_POLICY`, and the public API, from
the docstrings of what `fnt` exports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from fnt.config import markdown_keys

README = Path(__file__).resolve().parents[1] / "README.md"
KEYS_BLOCK = re.compile(r"(<!-- config-keys:start -->\n).*?(<!-- config-keys:end -->)", re.S)
API_BLOCK = re.compile(r"(<!-- api:start -->\n).*?(<!-- api:end -->)", re.S)
RESUME_BLOCK = re.compile(r"(<!-- resume-policy:start -->\n).*?(<!-- resume-policy:end -->)", re.S)
# Public names outside `fnt.__all__`: the step functions and the native optimizer.
EXTRA_API = (("steps", "sft_step"), ("steps", "rl_step"), ("fnt.optim", "CPUAdamW"))


def summary(obj) -> str:
    """The first sentence of an object's docstring, on one line."""
    paragraph = " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())
    sentence, dot, _ = paragraph.partition(". ")
    return sentence + ("." if dot or not sentence.endswith(".") else "")


def markdown_api() -> str:
    import fnt

    rows = [("fnt", name) for name in fnt.__all__] + list(EXTRA_API)
    lines = ["| name | import | what it is |", "| --- | --- | --- |"]
    for module, name in rows:
        obj = getattr(importlib.import_module(module), name)
        lines.append(f"| `{name}` | `from {module} import {name}` | {summary(obj)} |")
    return "\n".join(lines)


def markdown_resume_policy() -> str:
    from fnt.resume import POLICY_MEANINGS, RESUME_POLICY

    lines = ["| a key that differs from the checkpoint's | keys |", "| --- | --- |"]
    for policy, meaning in POLICY_MEANINGS.items():
        keys = ", ".join(f"`{key}`" for key, p in RESUME_POLICY.items() if p == policy)
        lines.append(f"| {meaning} | {keys} |")
    return "\n".join(lines)


def with_tables(text: str) -> str:
    note = "Keys of the `loss` and `rollout` sections apply to `fnt rl` only.\n\n"
    text = KEYS_BLOCK.sub(lambda m: m.group(1) + note + markdown_keys() + "\n" + m.group(2), text)
    text = RESUME_BLOCK.sub(
        lambda m: m.group(1) + markdown_resume_policy() + "\n" + m.group(2), text
    )
    return API_BLOCK.sub(lambda m: m.group(1) + markdown_api() + "\n" + m.group(2), text)


if __name__ == "__main__":
    README.write_text(with_tables(README.read_text()))
