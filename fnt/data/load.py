"""Read the JSONL sources and tokenize every sample once. Side effects: reads the source files.

Blank lines are skipped; any other line must be one record (see fnt.data.chat). Every problem
with a line raises DataError naming the file and the 1-based line number, before training starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Protocol, Sequence

from fnt.config import source_name
from fnt.data.chat import (
    ChatMasking,
    conversation_from_record,
    tokenize_conversation,
    tools_from_record,
)
from fnt.data.corpus import OVERLONG_POLICIES, Corpus, SampleFate, fit_to_length
from fnt.errors import DataError
from fnt.tokenizer import stop_token_ids


class Source(Protocol):
    path: str
    weight: float
    name: str


def load_corpus(
    sources: Sequence[Source],
    tokenizer,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking | None = None,
) -> Corpus:
    """Every source tokenized (a record may give several samples, see fnt.data.chat) and fitted
    to seq_len under the overlong policy; `masking` defaults to the assistant turns with the
    tokenizer's stop tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"data.overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if not sources:
        raise ValueError("data.sources is empty: give at least one JSONL file")
    if masking is None:
        masking = ChatMasking(stop_ids=stop_token_ids(tokenizer, tokenizer.name_or_path or None))
    if not (masking.chat_template or tokenizer.chat_template):
        raise ValueError(
            "the tokenizer has no chat template, which SFT data rendering needs; set "
            "data.chat_template"
        )
    names = [source_name(source) for source in sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"data source names must be unique (they key metrics); repeated: {duplicates}"
        )
    corpus = Corpus.build(
        (
            name,
            _fitted_samples(
                Path(source.path), tokenizer, seq_len=seq_len, overlong=overlong, masking=masking
            ),
        )
        for name, source in zip(names, sources)
    )
    first_id = 0
    for source, size in zip(sources, corpus.source_sizes):
        fates = corpus.fates[first_id : first_id + size]
        if all(fate.dropped for fate in fates):
            raise DataError(
                f"{source.path}: no sample is usable with seq_len={seq_len} and "
                f"data.overlong={overlong!r} "
                f"({fates.count(SampleFate.DROPPED_OVERLONG)} over-long, "
                f"{fates.count(SampleFate.DROPPED_NO_LOSS)} without target tokens)"
            )
        first_id += size
    return corpus


def _fitted_samples(
    path: Path, tokenizer, *, seq_len: int, overlong: str, masking: ChatMasking
) -> Iterator[tuple[list[int], list[bool], SampleFate]]:
    try:
        file = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read data source {path}: {e}") from e
    found = False
    with file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            found = True
            try:
                record = json.loads(line.decode("utf-8"))
                messages = conversation_from_record(record)
                samples = tokenize_conversation(
                    messages, tokenizer, masking, tools=tools_from_record(record)
                )
                fitted = [
                    fit_to_length(ids, targets, seq_len=seq_len, overlong=overlong)
                    for ids, targets in samples
                ]
            except ValueError as e:  # also bad JSON and bad UTF-8, which subclass ValueError
                raise DataError(f"{path}, line {line_number}: {e}") from e
            yield from fitted
    if not found:
        raise DataError(f"{path}: the file is empty (no JSONL records)")
