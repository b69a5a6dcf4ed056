"""Batch sources for the driver: `make_batches(state)` picks the configured data. Reads files.

Every source starts exactly at `state.progress` (step and data position), so a resumed run
sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

from typing import Iterator

from fnt.batch import SftBatch
from fnt.state import TrainState
from fnt.synthetic import synthetic_batches


def sft_batches(state: TrainState) -> Iterator[SftBatch]:
    """This rank's SFT batches for steps progress.step + 1, + 2, ... (synthetic or JSONL)."""
    config, runtime = state.config, state.handles.runtime
    common = dict(
        seed=config.seed,
        batch_size=config.batch_size,
        micro_batch_size=config.micro_batch_size,
        seq_len=config.seq_len,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dims.dp,
    )
    if config.data.kind == "synthetic":
        return synthetic_batches(
            start_step=state.progress.step, start=state.progress.data, **common
        )
    from transformers import AutoTokenizer

    from fnt.data import sft_batches as jsonl_batches

    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    return jsonl_batches(config.data, tokenizer, start=state.progress.data, **common)
