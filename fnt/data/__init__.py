"""The SFT data pipeline: JSONL chats to packed, rank-sharded batches, and synthetic debugging
data. Side effects: reading the sources (load, hub, the loaders of sft and pairs), reading and
writing the cache of tokenized sources (cache, which also gathers over the ranks) and
`chat_masking`'s reads of the chat template and generation_config.json (chat); corpus, order,
packing and synthetic are pure; this file only re-exports them.

    records (chat) -> Corpus (load, corpus) -> SampleOrder (order) -> StepPlan, PackedRows
    (packing) -> SftBatch per rank (sft: SourceData.batch)

The order of samples is a pure function of (seed, epoch, cursor); fnt.data.order defines what an
epoch is with weighted sources.
"""

from fnt.config import source_name
from fnt.data.chat import ChatMasking, conversation_from_record, tokenize_conversation
from fnt.data.corpus import Corpus, SampleFate, fit_to_length
from fnt.data.load import load_corpus
from fnt.data.order import SampleOrder, epoch_order, source_quotas
from fnt.data.packing import StepPlan, pack_rows, plan_step, step_metrics
from fnt.data.sft import SourceData, load_source_data, rank_batch
from fnt.data.synthetic import synthetic_batch, synthetic_rows
from fnt.errors import DataError

__all__ = [
    "ChatMasking",
    "Corpus",
    "SourceData",
    "DataError",
    "SampleFate",
    "SampleOrder",
    "StepPlan",
    "conversation_from_record",
    "epoch_order",
    "fit_to_length",
    "load_corpus",
    "load_source_data",
    "pack_rows",
    "plan_step",
    "rank_batch",
    "synthetic_batch",
    "synthetic_rows",
    "source_name",
    "source_quotas",
    "step_metrics",
    "tokenize_conversation",
]
