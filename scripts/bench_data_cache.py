"""The tokenized-data cache: what verifying an entry costs against reading it, on the README's
100k-chat corpus (the reverse-text chats of the Qwen3 example, with the tiny Qwen3 model's
tokenizer and Qwen3's chat template). Side effects: writes the data, the tiny model and the cache
under --work; drops the entry from the page cache (posix_fadvise) before each cold read.

    python scripts/bench_data_cache.py [--chats 100000] [--repeats 7] [--work DIR]

A read of an entry is three phases (fnt.data.cache.read_entry): reading the file, verifying its
bytes (format, size, the xxh3-128 digest of every array) and decoding them into samples. Prints
the median of each, cold (the file evicted first) and warm (in the page cache), the
verification's share of reading and decoding, and the time of a whole load of the corpus from
the cache; last, one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prepare(work: Path, chats: int) -> tuple[Path, Path]:
    """The reverse-text chats and the tiny Qwen3 model (made once in `work`)."""
    from fnt.model import tiny_model

    data = work / "data" / "sft.jsonl"
    if not data.is_file():
        make = [sys.executable, str(REPO / "examples/reverse_text/make_data.py")]
        subprocess.run([*make, "--out", str(data.parent), "--sft", str(chats)], check=True)
    model = work / "qwen3-tiny"
    if not (model / "config.json").is_file():
        template = REPO / "tests/fixtures/chat_templates/qwen3.json"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            tiny_model.main(
                ["--arch", "qwen3", "--out", str(model), "--chat-template", str(template)]
            )
    return data, model


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first, so that they can go)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def main() -> None:
    from fnt.config import DataSourceConfig
    from fnt.data import load_corpus
    from fnt.data.cache import DataCache, decode_entry, verify_entry
    from fnt.model.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-cache-"))
    data, model = prepare(work, args.chats)
    tokenizer = load_tokenizer(str(model))
    cache = DataCache(work / "cache")
    options = dict(seq_len=512, overlong="truncate", cache=cache)
    sources = [DataSourceConfig(path=str(data))]
    for stale in cache.directory.glob("*") if cache.directory.is_dir() else ():
        stale.unlink()
    tokenize_s, _ = timed(lambda: load_corpus(sources, tokenizer, **options))
    (entry,) = cache.directory.iterdir()

    phases: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    for _ in range(args.repeats):
        for kind in ("cold", "warm"):
            if kind == "cold":
                evict(entry)
            read_s, raw = timed(entry.read_bytes)
            verify_s, _ = timed(verify_entry, entry, raw)
            decode_s, _ = timed(decode_entry, entry, raw)
            for name, seconds in (("read", read_s), ("verify", verify_s), ("decode", decode_s)):
                phases[kind].setdefault(name, []).append(seconds)
    load_s = statistics.median(
        timed(lambda: load_corpus(sources, tokenizer, **options))[0] for _ in range(3)
    )
    result = {
        "chats": args.chats,
        "entry_mb": entry.stat().st_size / 1e6,
        "tokenize_s": tokenize_s,
        "load_from_cache_s": load_s,
    }
    print(f"{args.chats} chats, entry {result['entry_mb']:.1f} MB; tokenized in {tokenize_s:.1f} s")
    for kind, times in phases.items():
        median = {name: statistics.median(values) for name, values in times.items()}
        share = median["verify"] / (median["read"] + median["decode"])
        result[kind] = {**{f"{k}_ms": v * 1e3 for k, v in median.items()}, "verify_share": share}
        print(
            f"{kind}: read {median['read'] * 1e3:.1f} ms, verify {median['verify'] * 1e3:.1f} ms, "
            f"decode {median['decode'] * 1e3:.1f} ms: verification {share:.1%} of the read"
        )
    print(f"a whole load of the corpus from the cache (warm): {load_s:.2f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
