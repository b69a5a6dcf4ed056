"""The files a data source names: a directory's parquet and Arrow files, a glob pattern's
matches, each in name order. Shared by the loader (fnt.data.load) and preflight, which calls
them before any heavy import so that a source with no files is one error naming its config key.
Side effect: lists directories. No heavy imports.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional, Union

from fnt.config.schema import COLUMNAR_SUFFIXES
from fnt.errors import DataError


def directory_files(directory: Union[str, Path], name: Optional[str] = None) -> list[Path]:
    """The directory's parquet and Arrow files in name order; DataError when it has none, or
    when it holds a whole DatasetDict. `name` says what the directory is to the user in the
    message (default: the path)."""
    directory = Path(directory)
    shown = name or str(directory)
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise DataError(
            f"{shown} holds a DatasetDict saved with save_to_disk: point the source's path "
            f"at the directory of one split (one of {splits})"
        )
    files = sorted(p for p in directory.iterdir() if p.suffix in COLUMNAR_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"{shown}: the directory has no .parquet or .arrow files")
    return files


def glob_files(pattern: str, name: Optional[str] = None) -> list[Path]:
    """The files a glob pattern matches, in name order; DataError when it matches none. `name`
    as for `directory_files`."""
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"{name or pattern}: the pattern matches no file")
    return files
