"""Fixtures of the data tests: the tiny model's tokenizer and synthetic corpora."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
from transformers import AutoTokenizer

from fnt.data import Corpus, SampleFate


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's byte-level ChatML tokenizer (eos <|im_end|>, pad <|pad|>)."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def corpus_of(lengths: Sequence[Sequence[int]]) -> Corpus:
    """A corpus with one source per inner list; a sample of length 0 is a dropped one.

    Sample i's tokens are all (i % 200) + 1 so tests can tell samples apart after packing; its
    targets are every token but the first, as fit_to_length leaves them.
    """
    sources = []
    next_id = 0
    for s, source_lengths in enumerate(lengths):
        samples = []
        for length in source_lengths:
            if length == 0:
                samples.append(([], [], SampleFate.DROPPED_NO_LOSS))
            else:
                samples.append(
                    ([next_id % 200 + 1] * length, [False] + [True] * (length - 1), SampleFate.KEPT)
                )
            next_id += 1
        sources.append((f"s{s}", samples))
    return Corpus.build(sources)


@pytest.fixture(scope="session")
def make_corpus() -> Callable[[Sequence[Sequence[int]]], Corpus]:
    return corpus_of
