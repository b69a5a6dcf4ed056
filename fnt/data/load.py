"""Read the data sources and tokenize every sample once. Side effects: reads the source files, or
the `datasets` cache for a Hugging Face dataset (and the Hub, only when it is not cached there).

Each kind of source has a record reader, which yields (location, record) pairs in a fixed order:
- a JSONL file (any path that is not one of the kinds below): one record per non-blank line,
  located as `file, line N` (1-based);
- a parquet file (`.parquet`) or an Arrow IPC file (`.arrow`, file or stream format; the stream
  format is what `datasets.Dataset.save_to_disk` writes): one record per row, located as
  `file, row index i` (0-based, as `table[i]` counts);
- a directory: its `.parquet` and `.arrow` files, not those of its subdirectories, in name order;
- a glob pattern (a path with `*`, `?` or `[`): the files it matches, in name order, each read
  by its suffix as above (e.g. `snapshot/data/train-*.parquet` picks one split of a Hub layout);
- a Hugging Face dataset (`dataset`, `subset`, `split`), read with `datasets.load_dataset`:
  located as `dataset 'name' (subset 's', split 'train'), row index i`.
The order of the records depends only on the data, so sample ids, and with them the data order
and resume, are the same in every run on the same data. Every problem with a record raises
DataError naming its location, before training starts.

Columnar records (parquet, Arrow, datasets) have a field for every column, and a struct inside a
list (a message) has every field any of its siblings has; a missing value is null. Null values
are therefore dropped from columnar records, so a message has only the keys it was written with.
The source's column names then map a record to the keys fnt.data.chat reads (`chat_record`),
which reads it as one of its forms (fnt.data.chat.read_record: messages, conversations,
prompt/completion, text).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from fnt.config.schema import (
    COLUMNAR_SUFFIXES,
    repeated_source_names,
    source_kind,
    source_name,
)
from fnt.data.cache import DataCache, SourceSamples, cache_key
from fnt.data.chat import (
    BAD_SAMPLE_POLICIES,
    ChatMasking,
    SftRecord,
    bad_sample_action,
    chat_problem,
    check_tools_rendered,
    empty_turns,
    read_record,
    template_roles,
    tokenize_conversation,
    tokenize_text,
    tools_from_record,
    without_untrained_tail,
)
from fnt.data.corpus import (
    OVERLONG_POLICIES,
    Corpus,
    SampleFate,
    fit_to_length,
    overlong_policy,
)
from fnt.data.hub import load_hf_dataset
from fnt.errors import DataError
from fnt.model.tokenizer import stop_token_ids
from fnt.obs.console import say, with_progress
from fnt.store.jsonl import jsonl_records
from fnt.store.source_files import directory_files, glob_files

ROWS_PER_BATCH = 1024  # columnar rows converted to Python at a time


class DataSource(Protocol):
    path: str
    dataset: str
    subset: str
    split: str
    messages_column: str
    prompt_column: str
    completion_column: str
    weight: float
    name: str


def load_corpus(
    sources: Sequence[DataSource],
    tokenizer,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking | None = None,
    progress: bool = False,
    cache: DataCache | None = None,
    on_bad_sample: str = "auto",
) -> Corpus:
    """Every source tokenized (a record may give several samples, see fnt.data.chat) and fitted
    to seq_len under the overlong policy; `masking` defaults to the assistant turns with the
    model's stop tokens; `progress` shows the reading's progress (fnt.obs.console; rank 0);
    `cache` keeps and reuses the tokenized sources (fnt.data.cache); `on_bad_sample`
    (fnt.data.chat.bad_sample_action) decides whether a bad chat stops the run or is left out,
    with a located note."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"data.overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise ValueError(
            f"data.on_bad_sample must be one of {BAD_SAMPLE_POLICIES}, got {on_bad_sample!r}"
        )
    if not sources:
        raise ValueError("data.sources is empty: give at least one source")
    if masking is None:
        masking = ChatMasking(stop_ids=stop_token_ids(tokenizer, tokenizer.name_or_path or None))
    names = [source_name(source) for source in sources]
    repeated = repeated_source_names(sources)
    if repeated:
        raise ValueError(
            f"data source names must be unique (they key metrics); repeated: {repeated}"
        )
    parts = [
        (
            name,
            source_samples(
                source,
                tokenizer,
                seq_len=seq_len,
                overlong=overlong,
                masking=masking,
                progress=progress,
                cache=cache,
                on_bad_sample=on_bad_sample,
            ),
        )
        for name, source in zip(names, sources)
    ]
    corpus = Corpus.from_parts(
        [
            (name, samples.ids, samples.targets, samples.lengths, samples.fates, samples.records)
            for name, (samples, _) in parts
        ],
        cache_entries=tuple(entry for _, (_, entry) in parts),
    )
    first_id = 0
    for source, size in zip(sources, corpus.source_sizes):
        fates = corpus.fates[first_id : first_id + size]
        if all(fate.dropped for fate in fates):
            bad = fates.count(SampleFate.DROPPED_BAD)
            raise DataError(
                f"{source_label(source)}: no sample is usable with seq_len={seq_len} and "
                f"data.overlong={overlong!r} "
                f"({fates.count(SampleFate.DROPPED_OVERLONG)} over-long, "
                f"{fates.count(SampleFate.DROPPED_NO_LOSS)} without target tokens"
                f"{f', {bad} bad chats left out' if bad else ''})"
            )
        first_id += size
    notes = (
        tuple(
            f"{source_label(source)}: {len(samples.trailing)} chats end with turns that "
            f"data.loss_mask does not train (the first at {samples.trailing[0][1]}); those turns "
            "were left out"
            for source, (_, (samples, _)) in zip(sources, parts)
            if samples.trailing
        )
        + tuple(
            skipped_note(source_label(source), samples.skipped, on_bad_sample)
            for source, (_, (samples, _)) in zip(sources, parts)
            if samples.skipped
        )
        + tuple(
            empty_turns_note(source_label(source), samples.empty)
            for source, (_, (samples, _)) in zip(sources, parts)
            if samples.empty
        )
    )
    return dataclasses.replace(corpus, notes=notes)


SHOWN_PROBLEMS = 3  # located problems a message lists before it counts the rest


def skipped_note(label: str, skipped: Sequence[tuple[int, str, str]], policy: str) -> str:
    """One line on the chats a source left out: the first few with their location and reason,
    then a count. Pure."""
    shown = "; ".join(f"{location}: {reason}" for _, location, reason in skipped[:SHOWN_PROBLEMS])
    more = f"; and {len(skipped) - SHOWN_PROBLEMS} more" if len(skipped) > SHOWN_PROBLEMS else ""
    return f"{label}: {len(skipped)} chats left out (data.on_bad_sample={policy!r}): {shown}{more}"


def empty_turns_note(label: str, empty: Sequence[tuple[int, str, str]]) -> str:
    """One line on the chats with an empty trained assistant turn (it trains the end token, and
    white space at most): the first few with their location and turns, then a count. Pure."""
    shown = "; ".join(f"{location}: {turns}" for _, location, turns in empty[:SHOWN_PROBLEMS])
    more = f"; and {len(empty) - SHOWN_PROBLEMS} more" if len(empty) > SHOWN_PROBLEMS else ""
    return (
        f"{label}: {len(empty)} chats have an empty assistant turn (no text but white space), "
        f"which teaches the model to answer nothing: {shown}{more}"
    )


def bad_records_message(label: str, problems: Sequence[str], count: int, policy: str) -> str:
    """The error for a source with bad chats: a header line, the first few located problems,
    then a count. Pure."""
    more = [f"  ... and {count - len(problems)} more"] if count > len(problems) else []
    return "\n".join(
        [
            f'{label}: {count} bad records (data.on_bad_sample={policy!r}; "skip" leaves '
            "them out with a warning):",
            *(f"  {problem}" for problem in problems),
            *more,
        ]
    )


def source_samples(
    source: DataSource,
    tokenizer,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking,
    progress: bool,
    cache: DataCache | None,
    on_bad_sample: str = "auto",
) -> tuple[SourceSamples, str]:
    """A source's fitted samples, and the cache entry they were read from ("" when they were
    tokenized now): from `cache` when it holds them and they pass its check (else tokenized,
    split over the cache's ranks, and kept there; rank 0 prints a line for each damaged entry
    or share it replaced), or tokenized here without a cache. Every record is first checked in
    a quick pass that does not tokenize (`check_records`), so a bad line is reported as soon as
    it is read."""

    def tokenize(rank: int, world_size: int) -> SourceSamples:
        check_records(
            source, progress, masking=masking, tokenizer=tokenizer, on_bad_sample=on_bad_sample
        )
        return tokenize_share(
            source,
            tokenizer,
            seq_len=seq_len,
            overlong=overlong,
            masking=masking,
            rank=rank,
            world_size=world_size,
            progress=progress,
            on_bad_sample=on_bad_sample,
        )

    settings = masking_settings(
        masking, tokenizer, seq_len=seq_len, overlong=overlong, on_bad_sample=on_bad_sample
    )
    return cached_samples(source, tokenizer, tokenize, settings, cache, progress)


def masking_settings(
    masking: ChatMasking, tokenizer, *, seq_len: int, overlong: str, on_bad_sample: str = "auto"
) -> dict[str, Any]:
    """What a source's samples depend on besides its records and the tokenizer (fnt.data.cache's
    key): the template, the masking, seq_len and the overlong policy. Pure."""
    return {
        "template": masking.chat_template or tokenizer.chat_template,
        "loss_mask": sorted(masking.roles),
        "turns": masking.turns,
        "reasoning": masking.reasoning,
        "stop_ids": sorted(masking.stop_ids),
        "seq_len": seq_len,
        "overlong": overlong,
        "on_bad_sample": on_bad_sample,
    }


def cached_samples(
    source: DataSource,
    tokenizer,
    tokenize: Callable[[int, int], SourceSamples],
    settings: dict[str, Any],
    cache: DataCache | None,
    progress: bool,
) -> tuple[SourceSamples, str]:
    """`tokenize(rank, world_size)` of a source through `cache` (keyed by the source, its
    contents, the tokenizer and `settings`), or run once here without a cache; DataError for the
    first bad record. Also the cache entry the samples were read from ("" when they were
    tokenized now). An entry or share that fails the cache's check is replaced, and rank 0
    prints one line for each."""
    if cache is None:
        samples = tokenize(0, 1)
        if samples.error is not None:
            raise DataError(samples.error[1])
        return samples, ""
    key = cache_key(source, source_files(source), tokenizer, settings)
    read = cache.load(key, tokenize)
    if cache.rank == 0:
        for problem in read.problems:  # on every start, whether the progress shows or not
            print(problem, flush=True)
    if not read.hit:
        return read.samples, ""
    say(progress, f"{source_label(source)}: tokenized samples from the cache {cache.directory}")
    return read.samples, str(cache.entry(key))


def check_records(
    source: DataSource,
    progress: bool,
    check: Callable[[object], object] | None = None,
    *,
    masking: ChatMasking | None = None,
    tokenizer=None,
    on_bad_sample: str = "auto",
) -> None:
    """Read every record of a source and check it, without tokenizing: DataError with the
    location of the first few that on_bad_sample does not skip and their count, or for an empty
    source, or for a chat when there is no chat template. `check(record)` raises ValueError for
    a bad record (default: a record of one of fnt.data.chat's forms, through the source's
    columns, and with `masking` a chat's roles and trained turn, fnt.data.chat.chat_problem, or
    a text's emptiness)."""

    def problem_of(record: object) -> tuple[str, str] | None:
        if check is None:
            return record_problem(record, source, masking, roles)
        try:
            check(record)
        except ValueError as e:
            return "bad", str(e)
        return None

    found = False
    count = 0
    problems: list[str] = []
    roles = known_roles(masking, tokenizer) if masking is not None else None
    template = masking is None or bool(masking.chat_template or tokenizer.chat_template)
    records = with_progress(source_records(source), f"checking {source_label(source)}", progress)
    for location, record in records:
        found = True
        problem = problem_of(record)
        if not template and problem is None:
            form = read_record(chat_record(record, source)).form
            if form != "text":
                raise DataError(
                    f"{location}: a {form} record is rendered with the chat template, and the "
                    "tokenizer has none: set data.chat_template (a template file or its text)"
                )
        if problem is not None and bad_sample_action(problem[0], on_bad_sample) == "error":
            count += 1
            if len(problems) < SHOWN_PROBLEMS:
                problems.append(f"{location}: {problem[1]}")
    if count:
        raise DataError(bad_records_message(source_label(source), problems, count, on_bad_sample))
    if not found:
        kind = source_kind(source)
        empty = f"the {kind} has no rows"
        if kind == "jsonl":
            empty = "the file is empty (no JSONL records)"
        raise DataError(f"{source_label(source)}: {empty}")


def tokenize_share(
    source: DataSource,
    tokenizer,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking,
    rank: int,
    world_size: int,
    progress: bool,
    on_bad_sample: str = "auto",
) -> SourceSamples:
    """The fitted samples of every world_size-th record of a source, from record `rank` on; the
    first bad record stops it and is kept as the share's error (with its location)."""

    def fit(record: object) -> FittedRecord:
        return fit_record(
            record,
            source,
            tokenizer,
            seq_len=seq_len,
            overlong=overlong,
            masking=masking,
            on_bad_sample=on_bad_sample,
        )

    return fitted_share(source, fit, rank=rank, world_size=world_size, progress=progress)


def fitted_share(
    source: DataSource,
    fit: Callable[[object], Any],
    *,
    rank: int,
    world_size: int,
    progress: bool,
) -> SourceSamples:
    """`fit(record)` (a FittedRecord, or anything with its `samples` and `cut_turns`) of every
    world_size-th record of a source, from record `rank` on; the first record whose fit raises
    ValueError stops it and is kept as the share's error (with its location)."""
    share = SourceSamples()
    split = f" (every {world_size}th record on each rank)" if world_size > 1 else ""
    label = f"tokenizing {source_label(source)}{split}"
    records = with_progress(source_records(source), label, progress)
    for index, (location, record) in enumerate(records):
        if index % world_size != rank:
            continue
        try:
            fitted = fit(record)
        except ValueError as e:
            share.error = (index, f"{location}: {e}")
            break
        if getattr(fitted, "skipped", ""):
            share.skipped.append((index, location, fitted.skipped))
        if getattr(fitted, "empty_turns", ()):
            turns = ", ".join(f"messages[{i}]" for i in fitted.empty_turns)
            share.empty.append((index, location, turns))
        if fitted.cut_turns:
            share.trailing.append((index, location))
        for ids, targets, fate in fitted.samples:
            share.add(index, ids, targets, fate)
    return share


def source_files(source: DataSource) -> list[Path]:
    """The files a source reads, in order (none for a dataset, which `datasets` reads)."""
    kind = source_kind(source)
    if kind == "dataset":
        return []
    if kind == "directory":
        return directory_files(Path(source.path))
    if kind == "glob":
        return glob_files(source.path)
    return [Path(source.path)]


@dataclasses.dataclass(frozen=True)
class FittedRecord:
    """One record as the trainer sees it (`fit_record`)."""

    messages: list  # the chat, its untrained trailing turns cut (none for a text record)
    samples: list[tuple[list[int], list[bool], SampleFate]]  # fit_to_length's, per sample
    cut_turns: int  # trailing turns no role of the loss mask trains, left out
    full_lengths: list[int]  # each sample's tokens before fitting to seq_len
    skipped: str = ""  # why data.on_bad_sample left the record out ("" when it was not)
    read: SftRecord | None = None  # the record as read: its form (None when skipped)
    empty_turns: tuple[int, ...] = ()  # trained assistant turns with nothing but the end token


def known_roles(masking: ChatMasking, tokenizer) -> frozenset[str]:
    """The roles the masking's template (or the tokenizer's) renders (fnt.data.chat)."""
    return template_roles(str(masking.chat_template or tokenizer.chat_template or ""))


def record_problem(
    record: object, source: DataSource, masking: ChatMasking | None, roles: frozenset[str] | None
) -> tuple[str, str] | None:
    """(kind, reason) for a record that is not a good chat (fnt.data.chat.chat_problem; a record
    of the wrong shape is "bad") or text (an empty one is "no_trained_turn"), or None; only its
    shape is checked without `masking`. Pure."""
    try:
        read = read_record(chat_record(record, source))
    except ValueError as e:
        return "bad", str(e)
    if masking is None or roles is None:
        return None
    if read.form == "text":
        return None if read.text.strip() else ("no_trained_turn", "'text' is empty")
    return chat_problem(read.messages, known_roles=roles, trained_roles=masking.roles)


def fit_record(
    record: object,
    source: DataSource,
    tokenizer,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking,
    on_bad_sample: str = "auto",
) -> FittedRecord:
    """A record's chat, its samples (tokens, targets, fate) and what was cut; ValueError saying
    what is wrong with a bad record, unless on_bad_sample skips it: then one dropped sample, and
    the reason in `skipped`. A text record is one sample of its tokens, every one trained
    (fnt.data.chat.tokenize_text); over-long, it is truncated under data.overlong = "auto", as
    a prompt/completion pair is."""
    problem = record_problem(record, source, masking, known_roles(masking, tokenizer))
    if problem is not None:
        kind, reason = problem
        if bad_sample_action(kind, on_bad_sample) == "error":
            raise ValueError(reason)
        fate = SampleFate.DROPPED_NO_LOSS if kind == "no_trained_turn" else SampleFate.DROPPED_BAD
        return FittedRecord([], [([], [], fate)], 0, [0], skipped=reason)
    chat = chat_record(record, source)
    read = read_record(chat)
    if read.form == "text":
        messages, cut, empty = [], 0, []
        samples = [tokenize_text(read.text, tokenizer)]
    else:
        messages, cut = without_untrained_tail(read.messages, masking.roles)
        empty = empty_turns(messages, masking)
        tools = tools_from_record(chat)
        check_tools_rendered(messages, tokenizer, masking, tools)
        samples = tokenize_conversation(messages, tokenizer, masking, tools=tools)
    policy = overlong_policy(overlong, chat=read.form in ("messages", "conversations"))
    fitted = [
        fit_to_length(ids, targets, seq_len=seq_len, overlong=policy) for ids, targets in samples
    ]
    return FittedRecord(
        messages, fitted, cut, [len(ids) for ids, _ in samples], "", read, tuple(empty)
    )


# ---------------------------------------------------------------------------------------------
# Records to chats


CHAT_KEYS = ("messages", "prompt", "completion")
FIXED_KEYS = ("conversations", "text")
"""Keys read under their own (TRL's) names, unless a column setting names them: a ShareGPT
chat, and plain text, read only from a record without any chat column."""


def chat_record(record: object, source: DataSource) -> object:
    """The record with the source's columns renamed to the keys fnt.data.chat reads: messages,
    or prompt and completion; else `conversations`, else `text` (FIXED_KEYS). Keys with those
    names that are not the one read are left out, so a record is read through its configured
    columns only; every other key passes through, for the chat template. ValueError for a record
    without any of them, or with two chats; anything but a mapping is returned as it is, for
    fnt.data.chat to reject."""
    if not isinstance(record, Mapping):
        return record
    columns = dict(zip(CHAT_KEYS, _columns(source)))
    used = {column for column in columns.values() if column}
    fixed = [key for key in FIXED_KEYS if key not in used and key in record]
    present = {key for key, column in columns.items() if column and column in record}
    if not present and not fixed:
        wanted = [f"{columns['prompt']!r} and {columns['completion']!r}"] * bool(columns["prompt"])
        wanted += [repr(columns["messages"])] * bool(columns["messages"])
        wanted += [repr(key) for key in FIXED_KEYS if key not in used]
        raise ValueError(f"expected keys {', or '.join(wanted)}; got keys {sorted(record)}")
    if "messages" in present and present != {"messages"}:
        raise ValueError(
            f"the record has both the messages column {columns['messages']!r} and a prompt or "
            f"completion column ({columns['prompt']!r}, {columns['completion']!r}): set the "
            'columns this source does not use to "" (messages_column, or prompt_column and '
            "completion_column)"
        )
    if present and "conversations" in fixed:
        named = ", ".join(repr(columns[key]) for key in CHAT_KEYS if key in present)
        raise ValueError(
            f"the record has both 'conversations' (a ShareGPT chat) and the column {named}: "
            'set the columns this source does not use to "" (messages_column, or prompt_column '
            "and completion_column)"
        )
    for key in ("prompt", "completion"):
        if present and "messages" not in present and key not in present:
            raise ValueError(f"a prompt/completion record needs key {columns[key]!r}")
    out = {
        key: value
        for key, value in record.items()
        if key not in used and key not in CHAT_KEYS + FIXED_KEYS
    }
    for key in CHAT_KEYS:
        if key in present:
            out[key] = record[columns[key]]
    if not present:
        out[fixed[0]] = record[fixed[0]]  # conversations before text
    return out


def _columns(source: DataSource) -> tuple[str, str, str]:
    return source.messages_column, source.prompt_column, source.completion_column


def without_nulls(value: Any) -> Any:
    """`value` with every null-valued key of every mapping inside it removed (lists keep their
    items), as a columnar row means null for a field its record does not have. Pure."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


# ---------------------------------------------------------------------------------------------
# Record readers, one per kind of source


def source_label(source: DataSource) -> str:
    """How messages name a source: its path, or the dataset with its subset and split."""
    if source.dataset:
        subset = f"subset {source.subset!r}, " if source.subset else ""
        return f"dataset {source.dataset!r} ({subset}split {source.split!r})"
    return source.path


def record_location(source: DataSource, record: int) -> str:
    """The location of record `record` (0-based, in the source's order), read again: `file,
    line N` for a JSONL file, `file, row index i` for a columnar one."""
    for index, (location, _) in enumerate(source_records(source)):
        if index == record:
            return location
    return f"{source_label(source)}, record {record} (no longer there)"


def sample_origin(corpus: Corpus, sources: Sequence[DataSource], sample: int) -> tuple[str, str]:
    """Where sample `sample` of a corpus read from `sources` came from: its record's location
    (`record_location`, read again now: only for a message) and the cache entry its tokens were
    read from ("" when this run tokenized them)."""
    s = corpus.source_of(sample)
    if corpus.records is None or s >= len(sources):
        where = f"source {corpus.source_names[s]!r}, sample {sample}"
    else:
        where = record_location(sources[s], int(corpus.records[sample]))
    return where, dict(enumerate(corpus.cache_entries)).get(s, "")


def source_records(source: DataSource) -> Iterator[tuple[str, object]]:
    """(location, record) of every record of a source, in its fixed order."""
    kind = source_kind(source)
    if kind == "dataset":
        yield from dataset_records(source.dataset, source.subset, source.split)
    elif kind == "directory":
        for path in directory_files(Path(source.path)):
            yield from columnar_file_records(path)
    elif kind == "glob":
        for path in glob_files(source.path):
            yield from file_records(path)
    else:
        yield from file_records(Path(source.path))


def file_records(path: Path) -> Iterator[tuple[str, object]]:
    """The records of one file, read by its suffix: parquet, Arrow, else JSONL."""
    if path.suffix in COLUMNAR_SUFFIXES:
        return columnar_file_records(path)
    return jsonl_file_records(path)


def jsonl_file_records(path: Path) -> Iterator[tuple[str, object]]:
    """The parsed JSON of every non-blank line, located as `file, line N` (fnt.store.jsonl)."""
    for line_number, record in jsonl_records(path, f"data source {path}"):
        yield f"{path}, line {line_number}", record


def columnar_file_records(path: Path) -> Iterator[tuple[str, object]]:
    """The rows of a parquet or Arrow file as records, nulls dropped."""
    import pyarrow as pa

    index = 0
    try:
        for batch in _record_batches(path):
            for row in batch.to_pylist():
                yield f"{path}, row index {index}", without_nulls(row)
                index += 1
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read data source {path}: {e}") from e


def _record_batches(path: Path) -> Iterator[Any]:
    import pyarrow as pa

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_BATCH)
        return
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
    except pa.ArrowInvalid:  # not the file format: the stream format, as save_to_disk writes
        yield from pa.ipc.open_stream(pa.memory_map(str(path)))
        return
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def dataset_records(name: str, subset: str, split: str) -> Iterator[tuple[str, object]]:
    """The rows of a Hugging Face dataset split as records, nulls dropped."""
    dataset = load_hf_dataset(name, subset, split)
    subset_part = f"subset {subset!r}, " if subset else ""
    where = f"dataset {name!r} ({subset_part}split {split!r})"
    index = 0
    for table in dataset.with_format("arrow").iter(batch_size=ROWS_PER_BATCH):
        for row in table.to_pylist():
            yield f"{where}, row index {index}", without_nulls(row)
            index += 1
