"""The token-id check every batch passes (fnt.sources.checked_token_ids): `first_bad_token`
finds the first id outside the vocabulary with its place in the batch (the located errors of
real runs are tests/e2e/test_token_ids.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from fnt.batch import BadToken, DataPosition, SftBatch, first_bad_token
from fnt.data.packing import pack_rows

VOCAB = 50


@st.composite
def batches(draw) -> SftBatch:
    """Micro-batches of rows packing documents of ids in [-2, VOCAB + 2)."""
    seq_len = draw(st.integers(4, 12))
    micro_batches = []
    for _ in range(draw(st.integers(1, 3))):
        rows = []
        for _ in range(draw(st.integers(1, 3))):
            row, room = [], seq_len
            while room and draw(st.booleans()):
                n = draw(st.integers(1, room))
                ids = draw(st.lists(st.integers(-2, VOCAB + 1), min_size=n, max_size=n))
                row.append((torch.tensor(ids), torch.ones(n, dtype=torch.bool)))
                room -= n
            rows.append(row)
        micro_batches.append(pack_rows(rows, seq_len=seq_len, pad_token_id=0))
    return SftBatch(tuple(micro_batches), num_samples=1, data_after=DataPosition())


def scanned(batch: SftBatch) -> BadToken | None:
    """The first bad id in reading order, found one token at a time."""
    for m, mb in enumerate(batch.micro_batches):
        for r, row in enumerate(mb.input_ids.tolist()):
            for t, token in enumerate(row):
                if not 0 <= token < VOCAB:
                    document = int(mb.document_ids[r, t])
                    return BadToken(token, m, r, document, int(mb.position_ids[r, t]))
    return None


@given(batches())
def test_the_first_bad_token_is_the_first_in_reading_order_with_its_document(batch):
    assert first_bad_token(batch, VOCAB) == scanned(batch)


def test_the_offset_counts_within_the_document():
    rows = [[(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.bool)),
             (torch.tensor([4, 5, VOCAB, 6]), torch.ones(4, dtype=torch.bool))]]  # fmt: skip
    batch = SftBatch((pack_rows(rows, seq_len=8, pad_token_id=0),), 2, DataPosition())
    assert first_bad_token(batch, VOCAB) == BadToken(VOCAB, 0, 0, document=1, offset=2)
    assert first_bad_token(batch, VOCAB + 1) is None
