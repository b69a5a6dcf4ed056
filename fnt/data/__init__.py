"""The SFT data pipeline: JSONL chats to packed, rank-sharded batches. Pure except that
sft_batches and load_corpus read the source files.

    records (chat) -> Corpus (load, corpus) -> SampleOrder (order) -> StepPlan, PackedRows
    (packing) -> SftBatch per rank (sft)

The order of samples is a pure function of (seed, epoch, cursor); fnt.data.order defines what an
epoch is with weighted sources.
"""

from fnt.config import source_name
from fnt.data.chat import conversation_from_record, tokenize_conversation
from fnt.data.corpus import Corpus, SampleFate, fit_to_length
from fnt.data.load import load_corpus
from fnt.data.order import SampleOrder, epoch_order, source_quotas
from fnt.data.packing import StepPlan, pack_rows, plan_step, step_metrics
from fnt.data.sft import check_batch_layout, iter_sft_batches, rank_batch, sft_batches
from fnt.errors import DataError

__all__ = [
    "Corpus",
    "DataError",
    "SampleFate",
    "SampleOrder",
    "StepPlan",
    "check_batch_layout",
    "conversation_from_record",
    "epoch_order",
    "fit_to_length",
    "iter_sft_batches",
    "load_corpus",
    "pack_rows",
    "plan_step",
    "rank_batch",
    "sft_batches",
    "source_name",
    "source_quotas",
    "step_metrics",
    "tokenize_conversation",
]
