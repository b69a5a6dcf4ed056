"""The held-out evaluation of a DPO run (`fnt dpo`): `PairEvalData`, the state's `val` handle
(an Evaluator) holding the held-out pairs (val.sources), and the reference logprobs of every
pair computed once before training (`reference_table`), which share their passes over all pairs
(`corpus_pair_logps`).
Side effects: `load_pair_eval_data` reads the val sources; `reference_table` reads and, on
rank 0, writes its entry in the data cache; a pass over the pairs runs forward passes without
gradients, in eval mode and then back in the mode it was in, and all-reduces its sums (every
rank its share of the rows; all ranks finish together in that all-reduce).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from fnt.batch import to_device
from fnt.data.pairs import load_pair_corpus, pack_pairs, pair_masking
from fnt.distributed.collectives import all_reduce_max, all_reduce_sum
from fnt.distributed.runtime import Runtime
from fnt.evaluation.held_out import EvalMode, pack_in_order, rank_rows
from fnt.model.lm_head import loss_tokens_of
from fnt.model.lora import adapters_disabled
from fnt.model.tokenizer import load_tokenizer, pad_token_id
from fnt.preference import SUM_KEYS, PairLogps, needs_reference, pair_sums, sequence_sums
from fnt.state import Stateless, TrainState
from fnt.update import forward_loss_tokens


@torch.no_grad()
def corpus_pair_logps(
    model: nn.Module,
    corpus: Any,
    rows: tuple[tuple[int, ...], ...],
    runtime: Runtime,
    *,
    seq_len: int,
    micro_batch_size: int,
    chunk_tokens: int,
    pad_token_id: int,
    base: bool = False,
) -> Tensor:
    """[num_pairs, 2] float64: the summed response logprobs of both sides of the pairs in `rows`
    (all ranks' rows of pair ids; pairs in no row get 0), each rank computing its share in eval
    mode, then all-reduced. `base`: with LoRA adapters off (the reference)."""
    table = torch.zeros(corpus.num_samples, 2, dtype=torch.float64, device=runtime.device)
    mine = rank_rows(rows, runtime.dp_rank, runtime.dims.dp, micro_batch_size)
    with EvalMode(model), adapters_disabled(model) if base else contextlib.nullcontext():
        for i in range(0, len(mine), micro_batch_size):
            chunk = mine[i : i + micro_batch_size]
            mb = pack_pairs(chunk, corpus, seq_len=seq_len, pad_token_id=pad_token_id)
            mb = to_device(mb, runtime.device)
            _, logprobs = forward_loss_tokens(model, mb.rows, loss_tokens_of(mb.rows), chunk_tokens)
            ids = torch.tensor([p for row in chunk for p in row], dtype=torch.long)
            table[ids.to(runtime.device)] += sequence_sums(logprobs.logp.double(), mb)[0]
    return all_reduce_sum(table, runtime.distributed)


def reference_key(config: Any, corpus: Any) -> str:
    """The data cache's name of a corpus's reference table: a hash of the pairs' tokens and
    masks, the reference model (its directory's fingerprint), the dtypes, the attention kernel
    and seq_len (the rows it is computed in). Pure, apart from reading the model's index."""
    import xxhash

    from fnt.model.lora import base_fingerprint

    sides = corpus.sides
    hasher = xxhash.xxh3_128()
    hasher.update(sides.input_ids.numpy().tobytes())
    hasher.update(sides.target_mask.numpy().tobytes())
    hasher.update(repr(sides.offsets).encode())
    model = config.model
    reference = config.dpo.ref_model or model.name
    described = (
        f"{base_fingerprint(reference)}/{model.dtype}/{model.compute_dtype}/"
        f"{model.attn_implementation}/{config.seq_len}"
    )
    hasher.update(described.encode())
    return f"ref-{hasher.hexdigest()}"


def reference_table(
    ref_model: nn.Module,
    corpus: Any,
    config: Any,
    runtime: Runtime,
    cache_dir: Optional[Path],
    pad_token_id: int,
) -> Tensor:
    """[num_pairs, 2] float32: every pair's reference logprobs (chosen, rejected), read from
    `cache_dir` when it holds them, else computed (every rank a share, `corpus_pair_logps`)
    and, by rank 0, written there. Every rank decides alike whether to compute (an all-reduce)."""
    entry = None
    if cache_dir is not None:
        entry = Path(cache_dir) / f"{reference_key(config, corpus)}.pt"
    missing = entry is None or not entry.is_file()
    if not all_reduce_max([float(missing)], runtime)[0]:
        return torch.load(entry, weights_only=True).to(runtime.device)
    rows = pack_in_order([corpus.length(p) for p in range(corpus.num_samples)], config.seq_len)
    table = corpus_pair_logps(
        ref_model,
        corpus,
        rows,
        runtime,
        seq_len=config.seq_len,
        micro_batch_size=config.micro_batch_size,
        chunk_tokens=config.model.loss_chunk_tokens,
        pad_token_id=pad_token_id,
        base=True,
    ).float()
    if entry is not None and runtime.is_main:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        torch.save(table.cpu(), tmp)
        os.replace(tmp, entry)
    return table


@dataclass(frozen=True)
class PairEvalData(Stateless):
    """The held-out pairs (val.sources of a DPO run), packed in order, and their precomputed
    reference logprobs when dpo.precompute_reference is on (an Evaluator)."""

    corpus: Any
    """The val pairs, tokenized and fitted (a fnt.data.pairs.PairCorpus)."""
    rows: tuple[tuple[int, ...], ...]
    """All ranks' rows of val pair ids, packed in order."""
    pad_token_id: int
    reference: Optional[Tensor] = None
    """[num_pairs, 2] float32: the precomputed reference logprobs, or None."""

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """SUM_KEYS' means over the val pairs (without the val/ prefix) for the model as `state`
        holds it; the reference from the precomputed table, or state.handles.ref_model."""
        config, handles = state.config, state.handles
        options = dict(
            seq_len=config.seq_len,
            micro_batch_size=config.micro_batch_size,
            chunk_tokens=config.model.loss_chunk_tokens,
            pad_token_id=self.pad_token_id,
        )
        policy = corpus_pair_logps(
            handles.model, self.corpus, self.rows, handles.runtime, **options
        )
        ref = self.reference
        if ref is None and needs_reference(config.dpo):
            if handles.ref_model is None:
                raise ValueError("val pairs need the reference policy, and the state has none")
            ref = corpus_pair_logps(
                handles.ref_model, self.corpus, self.rows, handles.runtime, base=True, **options
            )
        ids = torch.tensor([p for row in self.rows for p in row], dtype=torch.long)
        counts = torch.tensor(
            [[int(self.corpus.side(p, s)[1].sum()) for s in (0, 1)] for p in ids.tolist()],
            dtype=torch.float64,
        ).reshape(-1, 2)
        policy = policy.cpu().double()[ids]
        ref = None if ref is None else ref.cpu().double()[ids]
        pairs = PairLogps(
            chosen=policy[:, 0],
            rejected=policy[:, 1],
            chosen_tokens=counts[:, 0],
            rejected_tokens=counts[:, 1],
            ref_chosen=None if ref is None else ref[:, 0],
            ref_rejected=None if ref is None else ref[:, 1],
        )
        sums = pair_sums(pairs, config.dpo)
        return {key: float(sums[key]) / max(len(ids), 1) for key in SUM_KEYS}


def load_pair_eval_data(config: Any) -> PairEvalData:
    """The val pairs of a DPO config (val.sources, with the data section's rendering and
    overlong settings); DataError for a bad file or line."""
    tokenizer = load_tokenizer(config.model.name)
    corpus = load_pair_corpus(
        config.val.sources,
        tokenizer,
        seq_len=config.seq_len,
        overlong=config.data.overlong,
        masking=pair_masking(config.data, tokenizer),
    )
    rows = pack_in_order([corpus.length(p) for p in range(corpus.num_samples)], config.seq_len)
    return PairEvalData(corpus, rows, pad_token_id(tokenizer))
