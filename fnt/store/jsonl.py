"""Reading JSONL files with errors that say where: the one reader of data sources, prompts and
preflight's first-record check. Side effect: reads the file. No heavy imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Union

from fnt.errors import DataError


def jsonl_records(
    path: Union[str, Path], name: Optional[str] = None
) -> Iterator[tuple[int, object]]:
    """(1-based line number, parsed JSON) of every non-blank line, in order.

    DataError `"{path}, line N: {reason}"` for a line that is not JSON (or not UTF-8), and
    `"{name}: cannot read it: {reason}"` for a file that cannot be opened, where `name` says what
    the file is to the user (default: the path).
    """
    try:
        file = open(path, "rb")
    except OSError as e:
        raise DataError(f"{name or path}: cannot read it: {e.strerror or e}") from e
    with file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {line_number}: not UTF-8 text ({e.reason})") from e
            try:
                yield line_number, json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {line_number}: {json_problem(e)}") from e


def json_problem(error: json.JSONDecodeError) -> str:
    """`invalid JSON at column C: reason` for an error in one line of JSONL. Pure.

    json's own message counts lines and columns in the string it was given, which for a JSONL
    line reads as a second, contradictory line number ("line 3: ... line 1 column 5")."""
    return f"invalid JSON at column {error.pos + 1}: {error.msg}"
