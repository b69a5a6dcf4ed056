"""Preference pairs: records of (prompt, chosen, rejected) to packed, rank-sharded pair batches.
Side effects: `load_pair_corpus` and `load_pair_data` read and tokenize the sources (through the
cache of tokenized sources, fnt.data.cache); `PairData.locate` reads a bad token's record again
(for its error message); the rest is pure.

Record formats (the keys are the source's columns: prompt_column, messages_column,
chosen_column, rejected_column):
- text: `{"prompt": "...", "chosen": "...", "rejected": "..."}`, rendered as the chats
  `[user: prompt, assistant: chosen]` and `[user: prompt, assistant: rejected]`;
- chat: the prompt as messages, `{"prompt": [...]}` (TRL's conversational format) or
  `{"messages": [...]}`, and each response a string, one assistant message, or a list holding
  one assistant message;
- implicit prompt: `{"chosen": [...], "rejected": [...]}`, two whole chats that share their
  messages up to a final assistant message each; the shared messages are the prompt.

Each side goes through SFT's chat rendering and masks (fnt.data.chat) with only its final
assistant turn trained: the response tokens, through the stop token, are the loss tokens, the
prompt is context. A pair is one unit of the data order and of packing: its two sides are
consecutive samples of a Corpus (2p the chosen side of pair p, 2p + 1 the rejected one) and
are packed into the same row, as two documents that cannot attend to each other, so one
forward computes both.

A pair must fit one row: with more than seq_len tokens in all it follows data.overlong
("auto": a chat pair is dropped, a text pair truncated). Truncation keeps the shorter side
whole when it fits in half a row, else cuts both to half a row; a pair left with a side without
a loss token is dropped. A pair whose chosen and rejected sides are the same tokens (nothing
to prefer: its loss is log 2 and its gradient 0) is dropped too, counted as data/dropped_bad
and named in a start-up note (`PairCorpus.notes`, which `load_pair_data` prints); a source
with nothing else is an error. Dropped pairs keep their ids
(so the data order does not depend on seq_len) and are counted as data/dropped_overlong,
data/dropped_no_loss or data/dropped_bad when a step meets them.

Messages may be written as SFT's are (fnt.data.chat.read_messages): ShareGPT's from/value, and
contents as lists of text parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor

from fnt.batch import BadToken, PackedRows, PairBatch, PairMicroBatch
from fnt.config.schema import repeated_source_names, source_name
from fnt.data.cache import DataCache, SourceSamples
from fnt.data.chat import (
    ChatMasking,
    chat_masking,
    conversation_from_record,
    read_messages,
    tokenize_conversation,
)
from fnt.data.corpus import (
    OVERLONG_POLICIES,
    Corpus,
    SampleFate,
    fit_to_length,
    overlong_policy,
)
from fnt.data.load import (
    SHOWN_PROBLEMS,
    DataSource,
    cached_samples,
    check_records,
    fitted_share,
    masking_settings,
    sample_origin,
    source_label,
)
from fnt.data.packing import StepPlan, pack_rows, step_metrics
from fnt.data.sft import PlannedData, source_order
from fnt.distributed.parallel import check_batch_layout, rank_share
from fnt.errors import DataError
from fnt.model.tokenizer import pad_token_id
from fnt.state import Progress

Message = Mapping[str, Any]
SIDES = ("chosen", "rejected")
SAME_SIDES = "chosen equals rejected"  # why a pair of equal sides is left out
PAIRS_FORMAT = "pairs-1"  # in the cache key: a pair source's entry is never read as SFT samples


class PairSource(DataSource, Protocol):
    chosen_column: str
    rejected_column: str


@dataclass(frozen=True)
class Pair:
    """One preference record as chats: the prompt and the two responses."""

    prompt: list[Message]
    chosen: Message
    rejected: Message
    chat: bool
    """The prompt came as messages (data.overlong = "auto" drops such a pair when too long)."""


def _response(value: object, key: str) -> Message:
    """A response column's value as one assistant message."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{key!r} must hold one assistant message, got {len(value)} messages")
        value = read_messages(value, key)[0][0]
    if not isinstance(value, Mapping) or value.get("role") != "assistant":
        raise ValueError(f"{key!r} must be a string or an assistant message")
    return dict(value)


def pair_from_record(record: object, source: PairSource) -> Pair:
    """The pair of one record read through the source's columns; ValueError saying what is wrong
    with a bad record. Pure."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    chosen_key, rejected_key = source.chosen_column, source.rejected_column
    if chosen_key not in record or rejected_key not in record:
        raise ValueError(
            f"a preference pair needs keys {chosen_key!r} and {rejected_key!r}; got keys "
            f"{sorted(record)}"
        )
    chosen, rejected = record[chosen_key], record[rejected_key]
    prompt_key, messages_key = source.prompt_column, source.messages_column
    if prompt_key and prompt_key in record:
        prompt = record[prompt_key]
        if isinstance(prompt, str):
            messages, chat = [{"role": "user", "content": prompt}], False
        elif isinstance(prompt, list):
            messages, chat = read_messages(prompt, prompt_key)[0], True
        else:
            raise ValueError(
                f"{prompt_key!r} must be a string or a list of messages, got "
                f"{type(prompt).__name__}"
            )
    elif messages_key and messages_key in record:
        messages, chat = read_messages(record[messages_key], messages_key)[0], True
    elif isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = (
            read_messages(chosen, chosen_key)[0],
            read_messages(rejected, rejected_key)[0],
        )
        # The shared prompt never takes a side's last message: two equal chats are a pair of
        # equal responses (dropped, counted), not a pair with no response.
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        messages, chat = chosen[:shared], True
        chosen, rejected = chosen[shared:], rejected[shared:]
    else:
        raise ValueError(
            f"no prompt: give {prompt_key!r} (a string or messages) or {messages_key!r}, or "
            f"{chosen_key!r} and {rejected_key!r} as whole chats that share the prompt"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("the prompt must be a non-empty list of messages")
    if isinstance(messages[-1], Mapping) and messages[-1].get("role") == "assistant":
        raise ValueError("the prompt must not end with an assistant message: that is a response")
    sides = [_response(chosen, chosen_key), _response(rejected, rejected_key)]
    # The SFT record checks (roles, contents, tool calls) of each side's whole chat.
    checked = [conversation_from_record({"messages": [*messages, side]}) for side in sides]
    return Pair(checked[0][:-1], checked[0][-1], checked[1][-1], chat)


def pair_masking(data_cfg: Any, tokenizer: Any) -> ChatMasking:
    """SFT's masking settings of `data_cfg`, training only each side's final assistant turn."""
    return dataclasses.replace(
        chat_masking(data_cfg, tokenizer), roles=frozenset({"assistant"}), turns="last"
    )


def side_limits(chosen: int, rejected: int, seq_len: int) -> tuple[int, int]:
    """The most tokens each side keeps when a pair of `chosen` + `rejected` tokens must fit
    seq_len: the shorter side whole when it fits in half a row, else half a row each. Pure."""
    if chosen + rejected <= seq_len:
        return chosen, rejected
    half = seq_len // 2
    if min(chosen, rejected) <= half:
        short = min(chosen, rejected)
        return (short, seq_len - short) if chosen == short else (seq_len - short, short)
    return seq_len - half, half


def fit_pair(
    chosen: tuple[Sequence[int], Sequence[bool]],
    rejected: tuple[Sequence[int], Sequence[bool]],
    *,
    seq_len: int,
    overlong: str,
) -> list[tuple[list[int], list[bool], SampleFate]]:
    """Both sides of a pair as they enter the corpus, fitted to share one row of seq_len tokens
    (`overlong` is the record's policy, "auto" resolved), both with the pair's fate. ValueError
    for an over-long pair under "error". Pure."""
    total = len(chosen[0]) + len(rejected[0])
    if total > seq_len and overlong == "error":
        raise ValueError(
            f"the pair has {total} tokens (chosen {len(chosen[0])}, rejected "
            f"{len(rejected[0])}), more than seq_len={seq_len}, and both sides share one row "
            "(data.overlong='error'; use 'truncate' or 'drop' to accept such pairs)"
        )
    if total > seq_len and overlong == "drop":
        return [([], [], SampleFate.DROPPED_OVERLONG)] * 2
    limits = side_limits(len(chosen[0]), len(rejected[0]), seq_len)
    fitted = [
        fit_to_length(ids, targets, seq_len=limit, overlong="truncate")
        for (ids, targets), limit in zip((chosen, rejected), limits)
    ]
    fates = [fate for *_, fate in fitted]
    if any(fate.dropped for fate in fates):
        lost = SampleFate.DROPPED_OVERLONG in fates
        return [([], [], SampleFate.DROPPED_OVERLONG if lost else SampleFate.DROPPED_NO_LOSS)] * 2
    fate = SampleFate.TRUNCATED if total > seq_len else SampleFate.KEPT
    return [(ids, targets, fate) for ids, targets, _ in fitted]


@dataclass(frozen=True)
class FittedPair:
    """A pair record as the trainer sees it (fnt.data.load.fitted_share reads these fields)."""

    samples: list[tuple[list[int], list[bool], SampleFate]]  # chosen, then rejected
    cut_turns: int = 0
    skipped: str = ""  # why the pair was left out ("" when it was not)


def fit_pair_record(
    record: object,
    source: PairSource,
    tokenizer: Any,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking,
) -> FittedPair:
    """A record's two sides, tokenized and fitted; ValueError for a bad record. A pair whose
    sides are the same tokens is left out (both sides dropped as bad, the reason in
    `skipped`)."""
    pair = pair_from_record(record, source)
    sides = []
    for response in (pair.chosen, pair.rejected):
        samples = tokenize_conversation([*pair.prompt, response], tokenizer, masking)
        if len(samples) != 1:  # one trained turn gives one sample (fnt.data.chat)
            raise ValueError(f"the template rendered the pair as {len(samples)} samples, not 1")
        sides.append(samples[0])
    if sides[0] == sides[1]:
        return FittedPair([([], [], SampleFate.DROPPED_BAD)] * 2, skipped=SAME_SIDES)
    policy = overlong_policy(overlong, chat=pair.chat)
    return FittedPair(fit_pair(*sides, seq_len=seq_len, overlong=policy))


@dataclass(frozen=True)
class PairCorpus:
    """Every pair of every source, tokenized; pair p's sides are samples 2p (chosen) and 2p + 1
    (rejected) of `sides`. Index with global pair ids; `length`, `tokens`, `fates`,
    `source_of`, `source_names` and `source_sizes` count pairs, as a Corpus counts samples, so
    the data order, packing plans and step metrics read either alike."""

    sides: Corpus
    notes: tuple[str, ...] = ()
    """What a reader of the data should know (one line each): the pairs left out."""

    @property
    def source_names(self) -> tuple[str, ...]:
        return self.sides.source_names

    @cached_property
    def source_sizes(self) -> tuple[int, ...]:
        return tuple(size // 2 for size in self.sides.source_sizes)

    @property
    def num_samples(self) -> int:
        return self.sides.num_samples // 2

    @cached_property
    def fates(self) -> tuple[SampleFate, ...]:
        return self.sides.fates[::2]

    def length(self, pair: int) -> int:
        """Tokens of both sides; 0 for a dropped pair."""
        return self.sides.length(2 * pair) + self.sides.length(2 * pair + 1)

    def side(self, pair: int, side: int) -> tuple[Tensor, Tensor]:
        """(input_ids [n] int64, target_mask [n] bool) of one side (0 chosen, 1 rejected)."""
        return self.sides.tokens(2 * pair + side)

    def tokens(self, pair: int) -> tuple[Tensor, Tensor]:
        """Both sides' (input_ids, target_mask), back to back."""
        chosen, rejected = self.side(pair, 0), self.side(pair, 1)
        return torch.cat([chosen[0], rejected[0]]), torch.cat([chosen[1], rejected[1]])

    def source_of(self, pair: int) -> int:
        return self.sides.source_of(2 * pair)


def load_pair_corpus(
    sources: Sequence[PairSource],
    tokenizer: Any,
    *,
    seq_len: int,
    overlong: str,
    masking: ChatMasking,
    progress: bool = False,
    cache: Optional[DataCache] = None,
) -> PairCorpus:
    """Every pair source tokenized and fitted (through `cache` when given); DataError for a bad
    record (file and line) or a source none of whose pairs fits."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"data.overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if not sources:
        raise ValueError("data.sources is empty: give at least one source of pairs")
    if not (masking.chat_template or tokenizer.chat_template):
        raise ValueError(
            "the tokenizer has no chat template, which pair rendering needs; set data.chat_template"
        )
    repeated = repeated_source_names(sources)
    if repeated:
        raise ValueError(
            f"data source names must be unique (they key metrics); repeated: {repeated}"
        )
    parts, entries, left_out = [], [], []
    for source in sources:
        settings = {
            "format": PAIRS_FORMAT,
            "columns": [source.chosen_column, source.rejected_column],
            **masking_settings(masking, tokenizer, seq_len=seq_len, overlong=overlong),
        }

        def tokenize(rank: int, world_size: int, source=source) -> SourceSamples:
            check_records(source, progress, check=lambda record: pair_from_record(record, source))
            return fitted_share(
                source,
                lambda record: fit_pair_record(
                    record, source, tokenizer, seq_len=seq_len, overlong=overlong, masking=masking
                ),
                rank=rank,
                world_size=world_size,
                progress=progress,
            )

        samples, entry = cached_samples(source, tokenizer, tokenize, settings, cache, progress)
        parts.append(
            (
                source_name(source),
                samples.ids,
                samples.targets,
                samples.lengths,
                samples.fates,
                samples.records,
            )
        )
        entries.append(entry)
        left_out.append([(location, why) for _, location, why in samples.skipped])
    notes = tuple(
        same_sides_note(source_label(source), same)
        for source, same in zip(sources, left_out)
        if same
    )
    corpus = PairCorpus(Corpus.from_parts(parts, cache_entries=tuple(entries)), notes)
    first = 0
    for source, size, same in zip(sources, corpus.source_sizes, left_out):
        fates = corpus.fates[first : first + size]
        if same and len(same) == size:
            raise DataError(
                f"{source_label(source)}: no pair is usable: in every one of its {size} pairs "
                f"the chosen response equals the rejected one (the first at {same[0][0]}), so "
                "there is nothing to prefer"
            )
        if all(fate.dropped for fate in fates):
            raise DataError(
                f"{source_label(source)}: no pair is usable with seq_len={seq_len} and "
                f"data.overlong={overlong!r} ({fates.count(SampleFate.DROPPED_OVERLONG)} "
                f"over-long, {fates.count(SampleFate.DROPPED_NO_LOSS)} without response tokens"
                f"{f', {len(same)} with chosen equal to rejected' if same else ''})"
            )
        first += size
    return corpus


def same_sides_note(label: str, same: Sequence[tuple[str, str]]) -> str:
    """One line on the pairs a source left out because chosen equals rejected: the first few
    locations, then a count. Pure."""
    shown = "; ".join(location for location, _ in same[:SHOWN_PROBLEMS])
    more = f"; and {len(same) - SHOWN_PROBLEMS} more" if len(same) > SHOWN_PROBLEMS else ""
    return (
        f"{label}: {len(same)} pairs left out, their chosen equal to their rejected "
        f"(data/dropped_bad): {shown}{more}"
    )


def pack_pairs(
    rows: Sequence[Sequence[int]],
    corpus: PairCorpus,
    *,
    seq_len: int,
    pad_token_id: int,
    reference: Optional[Tensor] = None,
) -> PairMicroBatch:
    """Rows of pair ids as one micro-batch: each pair's chosen and rejected sides as two
    documents of its row; `reference` [num_pairs, 2] (the precomputed reference logprobs of every
    pair of the corpus) gives the micro-batch's ref_logps. Pure."""
    packed: PackedRows = pack_rows(
        [[corpus.side(p, s) for p in row for s in (0, 1)] for row in rows],
        seq_len=seq_len,
        pad_token_id=pad_token_id,
    )
    sequence_ids = torch.full(packed.input_ids.shape, -1, dtype=torch.int64)
    pair_ids: list[int] = []
    for r, row in enumerate(rows):
        at = 0
        for p in row:
            for s in (0, 1):
                n = len(corpus.side(p, s)[0])
                sequence_ids[r, at : at + n] = 2 * len(pair_ids) + s
                at += n
            pair_ids.append(p)
    ref = None if reference is None else reference[torch.tensor(pair_ids, dtype=torch.long)]
    return PairMicroBatch(packed, sequence_ids, len(pair_ids), ref)


@dataclass(frozen=True)
class PairData(PlannedData):
    """DPO's data: tokenized pairs (a SampleSource whose batches are PairBatches); `sources`
    are the pair sources the corpus was read from."""

    corpus: PairCorpus
    reference: Optional[Tensor] = None
    """[num_pairs, 2] float32: every pair's reference logprobs (dpo.precompute_reference)."""

    def batch(self, progress: Progress) -> PairBatch:
        """This rank's batch of the update after `progress`."""
        return self.rank_batch(self.plan(progress))

    def locate(self, progress: Progress, bad: BadToken) -> str:
        """Where a token of this rank's batch after `progress` comes from: its pair's record
        (read again now: only for a message), the side and the token's place in it, and the
        cache entry the tokens were read from."""
        rows = rank_share(
            self.plan(progress).rows, self.dp_rank, self.dp_size, what="rows per step"
        )
        row = rows[bad.micro_batch * self.micro_batch_size + bad.row]
        if bad.document >= 2 * len(row):  # each pair is two documents: chosen, rejected
            return (
                f"the padding of update {progress.step + 1}'s row {bad.row} in micro-batch "
                f"{bad.micro_batch} (the tokenizer's pad token)"
            )
        pair, side = row[bad.document // 2], bad.document % 2
        where, entry = sample_origin(self.corpus.sides, self.sources, 2 * pair + side)
        cached = f" (read from the cache entry {entry})" if entry else ""
        return f"{where}, token {bad.offset} of its {SIDES[side]} side{cached}"

    def rank_batch(self, plan: StepPlan) -> PairBatch:
        """This rank's share of a planned step, as micro-batches, with the step's data metrics
        (data/num_samples counts pairs)."""
        rows = rank_share(plan.rows, self.dp_rank, self.dp_size, what="rows per step")
        micro_batches = tuple(
            pack_pairs(
                rows[i : i + self.micro_batch_size],
                self.corpus,
                seq_len=self.seq_len,
                pad_token_id=self.pad_token_id,
                reference=self.reference,
            )
            for i in range(0, len(rows), self.micro_batch_size)
        )
        return PairBatch(
            micro_batches=micro_batches,
            num_samples=sum(len(row) for row in rows),
            data_after=plan.data_after,
            metrics=step_metrics(plan, self.corpus, seq_len=self.seq_len),
        )


def load_pair_data(
    data_cfg: Any,
    tokenizer: Any,
    *,
    seed: int,
    seq_len: int,
    batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    progress: bool = False,
    cache: Optional[DataCache] = None,
) -> PairData:
    """Read and tokenize the pair sources of `data_cfg` (data.sources, data.overlong,
    data.shuffle, data.train_reasoning, data.chat_template); the batch layout is checked before
    any file is read. With `progress` (rank 0), the corpus's notes are printed, one line
    each."""
    check_batch_layout(batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    corpus = load_pair_corpus(
        data_cfg.sources,
        tokenizer,
        seq_len=seq_len,
        overlong=data_cfg.overlong,
        masking=pair_masking(data_cfg, tokenizer),
        progress=progress,
        cache=cache,
    )
    if progress:
        for note in corpus.notes:
            print(note, flush=True)
    return PairData(
        corpus,
        source_order(corpus.source_sizes, data_cfg, seed),
        seq_len,
        batch_size,
        micro_batch_size,
        dp_rank,
        dp_size,
        pad_token_id=pad_token_id(tokenizer),
        sources=tuple(data_cfg.sources),
    )
