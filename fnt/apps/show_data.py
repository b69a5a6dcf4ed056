"""`fnt show-data --config cfg.toml [--n 3] [--key=value]...`: the first samples of the SFT data
as the trainer sees them, with the tokens it trains on marked. Side effects: reads the data and
the tokenizer, prints.

Each sample is the text of its tokens, decoded run by run: context as it is, trained tokens
between `[[` and `]]` (or in green on a terminal), after a header with its source location,
its token counts (all, trained, context), its fate (kept, truncated, dropped) and the form its
record was read as (fnt.data.chat.RECORD_FORMS) with the roles of the chat's messages
(`record_summary`: a ShareGPT speaker with the role it became, `1 gpt as assistant`). The
samples go through the same code as training (fnt.data.load.fit_record: the template, the loss
mask, cut trailing turns, seq_len and data.overlong).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Iterator, Sequence

GREEN, RESET = "\x1b[32m", "\x1b[0m"


def marked_text(pieces: Sequence[tuple[str, bool]], color: bool) -> str:
    """The pieces' text, trained pieces between `[[` and `]]` (green with `color`). Pure."""
    start, end = (GREEN, RESET) if color else ("[[", "]]")
    return "".join(f"{start}{text}{end}" if trained else text for text, trained in pieces)


def runs(ids: Sequence[int], targets: Sequence[bool]) -> Iterator[tuple[list[int], bool]]:
    """The tokens cut into runs of equal target flags, in order. Pure."""
    run: list[int] = []
    for i, (token, target) in enumerate(zip(ids, targets)):
        if run and target != targets[i - 1]:
            yield run, bool(targets[i - 1])
            run = []
        run.append(token)
    if run:
        yield run, bool(targets[len(ids) - 1])


def record_summary(read, messages: Sequence) -> str:
    """The form a record was read as and its messages' roles: `messages: 1 user, 1 assistant`,
    `conversations (from/value): 1 human as user, 1 gpt as assistant`, `prompt/completion: ...`,
    `text: every token trained`; `(content parts joined)` when a content was a list of text
    parts. `read` is the fnt.data.chat.SftRecord (None for a record left out: its roles are
    unknown) and `messages` the chat as trained, its untrained trailing turns cut. Pure."""
    if read is not None and read.form == "text":
        return "text: every token trained"
    speakers = read.speakers if read is not None else ()
    roles = Counter(
        f"{speaker} as {message['role']}"
        if speaker and speaker.lower() != message["role"]
        else message["role"]
        for message, speaker in zip(messages, speakers or [""] * len(messages))
    )
    form = read.form if read is not None else "messages"
    how = " (from/value)" if speakers else ""
    joined = " (content parts joined)" if read is not None and read.joined_parts else ""
    return f"{form}{how}: {', '.join(f'{n} {role}' for role, n in roles.items())}{joined}"


def sample_header(
    location: str,
    ids: Sequence[int],
    targets: Sequence[bool],
    fate,
    summary: str,
    *,
    full_length: int,
    seq_len: int,
) -> str:
    """`train.jsonl, line 1: 42 tokens (6 trained, 36 context), kept; messages: 1 user, ...`
    (`summary`, `record_summary`'s); a sample fitting cut or dropped for its length says its
    length and the limit. Pure."""
    from fnt.data.corpus import SampleFate

    trained = sum(map(bool, targets))
    tokens = f"{len(ids)} tokens ({trained} trained, {len(ids) - trained} context)"
    if fate == SampleFate.DROPPED_OVERLONG or fate == SampleFate.TRUNCATED:
        tokens = f"{full_length} tokens, over seq_len={seq_len}"
        if fate == SampleFate.TRUNCATED:
            tokens += f", cut to {len(ids)} ({trained} trained, {len(ids) - trained} context)"
    elif fate.dropped:
        tokens = f"{full_length} tokens"
    return f"== {location}: {tokens}, {fate.name.lower()}; {summary}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fnt show-data",
        description="Print the first SFT samples as the trainer sees them, trained tokens marked.",
        epilog="Other options are config keys, as for `fnt sft` (e.g. --seq-len 512).",
        allow_abbrev=False,  # the rest are config keys, never abbreviations of these two
    )
    parser.add_argument("--n", type=int, default=3, help="how many samples to show (default 3)")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="green trained tokens instead of [[...]] (auto: on a terminal)",
    )
    args, rest = parser.parse_known_args(argv)
    from fnt.apps.cli import parse_config
    from fnt.apps.preflight import check_model_and_data
    from fnt.config import ConfigError

    config, model_name_source = parse_config(rest)
    if config.data.kind != "sources":
        raise ConfigError(
            f"data.kind = {config.data.kind!r}: show-data shows data.sources (data.kind = "
            '"sources")'
        )
    check_model_and_data(config, model_name_source)
    show(config, args.n, args.color == "always" or (args.color == "auto" and sys.stdout.isatty()))


def show(config, n: int, color: bool) -> None:
    """Print the first `n` samples of the config's data sources, in source order."""
    from fnt.data.chat import chat_masking
    from fnt.data.load import fit_record, source_records
    from fnt.errors import DataError
    from fnt.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model.name)
    masking = chat_masking(config.data, tokenizer)
    shown = 0
    for source in config.data.sources:
        for location, record in source_records(source):
            try:
                fitted = fit_record(
                    record,
                    source,
                    tokenizer,
                    seq_len=config.seq_len,
                    overlong=config.data.overlong,
                    masking=masking,
                    on_bad_sample=config.data.on_bad_sample,
                )
            except ValueError as e:
                raise DataError(f"{location}: {e}") from e
            summary = record_summary(fitted.read, fitted.messages)
            for (ids, targets, fate), full_length in zip(fitted.samples, fitted.full_lengths):
                header = sample_header(
                    location,
                    ids,
                    targets,
                    fate,
                    summary,
                    full_length=full_length,
                    seq_len=config.seq_len,
                )
                cut = f" ({fitted.cut_turns} trailing turns left out)" if fitted.cut_turns else ""
                empty = ", ".join(f"messages[{i}]" for i in fitted.empty_turns)
                if empty:
                    cut += f" (empty assistant turn: {empty})"
                print(header + cut)
                pieces = [(tokenizer.decode(run), trained) for run, trained in runs(ids, targets)]
                why = f"left out: {fitted.skipped}" if fitted.skipped else "no tokens left"
                print(marked_text(pieces, color) if ids else f"(dropped: {why})")
                shown += 1
                if shown >= n:
                    return
