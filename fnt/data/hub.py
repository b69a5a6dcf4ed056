"""Hugging Face datasets, read from the local `datasets` cache first. Side effects: reads the
cache and, only for a dataset that is not cached and not in offline mode, the Hub.

Both the readers of data sources (fnt.data.load) and the tokenize cache's key (fnt.data.cache,
a dataset's fingerprint) load datasets through `load_hf_dataset`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from fnt.errors import DataError


def load_hf_dataset(name: str, subset: str, split: str):
    """A split of a Hugging Face dataset, from the local `datasets` cache when it is there.

    The cache is tried first, with the Hub switched off: a dataset that is cached loads without
    any network (no retries against an unreachable Hub), and a resumed run reads the same
    revision the run started with, not a newer one pushed in between. Only a dataset that is not
    cached is looked up on the Hub (downloaded into the cache), and not at all in offline mode
    (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE). Every failure is a DataError naming the dataset.
    """
    import datasets

    subset_part = f"subset {subset!r}, " if subset else ""
    label = f"Hugging Face dataset {name!r} ({subset_part}split {split!r})"
    cache = datasets.config.HF_DATASETS_CACHE
    offline = datasets.config.HF_HUB_OFFLINE
    try:
        with _cache_only(datasets):
            return datasets.load_dataset(name, subset or None, split=split)
    except Exception as e:  # datasets signals a cache miss with several exception types
        cache_miss = e
    if offline:
        raise DataError(
            f"{label} is not in the local datasets cache ({cache}) and offline mode is on "
            f"(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE): {cache_miss}. Load it once with network "
            f"access (datasets.load_dataset({name!r}, {subset or None!r}, split={split!r})) so "
            "that it is cached, or point the source's path at local parquet files"
        ) from cache_miss
    try:
        return datasets.load_dataset(name, subset or None, split=split)
    except ConnectionError as e:
        raise DataError(
            f"{label} is not in the local datasets cache ({cache}: {cache_miss}) and the Hugging "
            f"Face Hub cannot be reached ({e}): load it once with network access so that it is "
            "cached, or point the source's path at local parquet files"
        ) from e
    except Exception as e:
        raise DataError(f"cannot load {label}: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _cache_only(datasets) -> Iterator[None]:
    """`datasets` in offline mode, and quiet, inside the block.

    datasets reads its offline switch from `datasets.config` at each call (the environment
    variables set it at import), so switching it here works whenever datasets was imported. Its
    warning that the dataset "couldn't be found on the Hub" would be wrong here: the Hub was not
    asked.
    """
    saved = datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved[0]
        datasets.logging.set_verbosity(saved[1])
