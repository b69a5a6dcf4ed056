"""Regenerate the config-key table of README.md from the config dataclasses (writes README.md)."""

from __future__ import annotations

import re
from pathlib import Path

from fnt.config import markdown_keys

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- config-keys:start -->\n).*?(<!-- config-keys:end -->)", re.S)


def with_keys(text: str) -> str:
    note = "Keys of the `loss` and `rollout` sections apply to `scripts/rl.py` only.\n\n"
    return BLOCK.sub(lambda m: m.group(1) + note + markdown_keys() + "\n" + m.group(2), text)


if __name__ == "__main__":
    README.write_text(with_keys(README.read_text()))
