"""Batch types that data sources produce and step functions consume. Pure: no side effects.

A batch is everything one rank needs for one optimizer step. Packed rows hold several documents
each; `document_ids` says which tokens belong together so attention never crosses a document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor


def host_array(t: Tensor) -> np.ndarray:
    """The values of `t` on the host: a CPU tensor's own memory, read without any torch op; a
    device tensor is copied back, which waits for the device's queue (a step's batches come
    from their source on the host, so their checks and layouts cost the device nothing)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


@dataclass(frozen=True)
class DataPosition:
    """Where a data stream stands; the sample order is a pure function of (seed, epoch, cursor)."""

    epoch: int = 0
    """Completed passes over the data."""
    cursor: int = 0
    """Samples consumed from the current epoch's order, summed over all ranks."""


@dataclass(frozen=True)
class PackedRows:
    """One micro-batch of rows, each row packing one or more documents back to back."""

    input_ids: Tensor  # [B, T] int64
    position_ids: Tensor  # [B, T] int64, restarts at 0 at each document start
    # [B, T] int64, equal within a document, different across documents of a row
    document_ids: Tensor
    loss_mask: Tensor  # [B, T] bool, True where token t is a training target predicted from t-1

    def check(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(shape)}")
        for name in ("position_ids", "document_ids", "loss_mask"):
            t = getattr(self, name)
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        for name in ("input_ids", "position_ids", "document_ids"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {getattr(self, name).dtype}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        # A document's first token has no predecessor inside the document, so it cannot be a target.
        if (host_array(self.loss_mask) & (host_array(self.position_ids) == 0)).any():
            raise ValueError("loss_mask marks a document's first token (position 0) as a target")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass(frozen=True)
class RowLayout:
    """Where a micro-batch's documents and loss tokens lie, read on the host from the batch as
    its source built it, so that a step on a device never reads a value back from there (each
    read stalls the device's queue until everything queued before it has run)."""

    document_lengths: tuple[tuple[int, ...], ...]
    """Per row, the token count of each of its documents (runs of equal document_ids), in order."""
    # [N] int64 on the rows' device: the flat positions b * T + t of the logits that predict a
    # loss token, i.e. where loss_mask[b, t + 1]; row-major, the order of `x[:, 1:][mask]`.
    loss_index: Tensor
    # [N] int64 on the rows' device: the sample of each loss token, numbered 0..S-1 over the
    # micro-batch; a sample is a (row, document) pair with loss tokens, so padding never counts.
    loss_sample: Tensor
    num_samples: int
    """S, the documents of the micro-batch that have loss tokens."""

    @property
    def num_loss_tokens(self) -> int:
        return self.loss_index.shape[0]

    def to(self, device: torch.device) -> RowLayout:
        """The layout with its index tensors on `device` (copies queued without waiting)."""
        non_blocking = device.type != "cpu"
        return dataclasses.replace(
            self,
            loss_index=self.loss_index.to(device, non_blocking=non_blocking),
            loss_sample=self.loss_sample.to(device, non_blocking=non_blocking),
        )

    @property
    def one_document_per_row(self) -> bool:
        return all(len(row) == 1 for row in self.document_lengths)


def host_layout(document_ids: np.ndarray, loss_mask: np.ndarray) -> RowLayout:
    """The RowLayout of host arrays [B, T] (the loss index on the CPU)."""
    lengths = []
    for row in document_ids:
        cuts = np.flatnonzero(row[1:] != row[:-1]) + 1
        lengths.append(tuple(int(n) for n in np.diff([0, *cuts, row.shape[0]])))
    predicts = np.zeros(loss_mask.shape, dtype=bool)
    predicts[:, :-1] = loss_mask[:, 1:]
    rows = np.arange(document_ids.shape[0])[:, None]
    # Document ids are below T (every document has a token), so each (row, id) key is unique.
    keys = (rows * document_ids.shape[1] + document_ids)[:, 1:][loss_mask[:, 1:]]
    unique, samples = np.unique(keys, return_inverse=True)
    return RowLayout(
        document_lengths=tuple(lengths),
        loss_index=torch.from_numpy(np.flatnonzero(predicts)),
        loss_sample=torch.from_numpy(samples.reshape(-1).astype(np.int64)),
        num_samples=len(unique),
    )


def row_layout(rows: PackedRows) -> RowLayout:
    """The rows' layout: kept from their host copy when `to_device` moved them, else read now
    (from rows on a device that reads the values back once) and kept with the rows."""
    layout = rows.__dict__.get("_layout")
    if layout is None:
        device = rows.input_ids.device
        layout = host_layout(host_array(rows.document_ids), host_array(rows.loss_mask))
        layout = layout.to(device)
        # Not a field: dataclasses.replace makes rows without it, whose layout is read anew.
        object.__setattr__(rows, "_layout", layout)
    return layout


def block_causal_mask(document_ids: Tensor) -> Tensor:
    """Boolean attention mask [B, 1, T, T]: True where query i may attend key j.

    A key is visible when it is not in the future and belongs to the same document. Restarted
    position ids alone do not isolate packed documents in transformers' sdpa path, so this mask
    is always passed explicitly.
    """
    T = document_ids.shape[-1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal)[:, None, :, :]


@dataclass(frozen=True)
class SftBatch:
    """This rank's share of one SFT optimizer step."""

    micro_batches: tuple[PackedRows, ...]
    """Micro-batches run forward/backward one after another, then one optimizer update."""
    num_samples: int
    """Documents (samples) in this rank's share."""
    data_after: DataPosition
    """The data position after this step, the same on every rank."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Data-side metrics of this step (e.g. per-source ratios), logged in the step's row."""

    def check(self) -> None:
        if not self.micro_batches:
            raise ValueError("an SftBatch needs at least one micro-batch")
        for mb in self.micro_batches:
            mb.check()


@dataclass(frozen=True)
class RLMicroBatch:
    """One micro-batch of packed RL samples (prompt + completion per document).

    Per-token tensors are aligned with `rows.input_ids`: the value at t belongs to token t, the
    target predicted from t-1 (so position 0 of a document never carries loss).
    """

    rows: PackedRows  # loss_mask: True on completion tokens
    advantages: Tensor  # [B, T] float32, the sample's advantage on its tokens, or each turn's
    temperatures: Tensor  # [B, T] float32, the sampling temperature of token t (> 0)
    inference_logprobs: Optional[Tensor]  # [B, T] float32, log p_sampler(token t) or None
    sample_lengths: tuple[tuple[int, ...], ...]  # per row, the token count of each document
    # [B, T] float32, log p_reference(token t) at its temperature, or None (loss.ref_kl_tau)
    ref_logprobs: Optional[Tensor] = None
    # [B, T] float32 in (0, 1], the nucleus (top-p) token t was sampled from, or None: 1, the
    # full vocabulary (fnt.model.lm_head: the trainer's logprobs then use the same nucleus)
    top_ps: Optional[Tensor] = None

    def check(self) -> None:
        self.rows.check()
        shape = self.rows.input_ids.shape
        tensors = {"advantages": self.advantages, "temperatures": self.temperatures}
        for name in ("inference_logprobs", "ref_logprobs", "top_ps"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        for name, t in tensors.items():
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if (host_array(self.temperatures)[host_array(self.rows.loss_mask)] <= 0).any():
            raise ValueError("temperatures must be > 0 on loss tokens")
        if self.top_ps is not None:
            top_ps = host_array(self.top_ps)[host_array(self.rows.loss_mask)]
            if not ((top_ps > 0) & (top_ps <= 1)).all():
                raise ValueError("top_ps must be in (0, 1] on loss tokens")
        if len(self.sample_lengths) != shape[0]:
            raise ValueError(
                f"sample_lengths has {len(self.sample_lengths)} rows, expected {shape[0]}"
            )
        for row, lengths in enumerate(self.sample_lengths):
            if sum(lengths) > shape[1]:
                raise ValueError(
                    f"row {row}: sample lengths {lengths} exceed the row length {shape[1]}"
                )


@dataclass(frozen=True)
class RLBatch:
    """This rank's share of one RL optimizer step."""

    micro_batches: tuple[RLMicroBatch, ...]
    num_samples: int
    """Completions (documents) in this rank's share."""
    data_after: DataPosition
    """The prompt-stream position after this step, the same on every rank."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Rollout metrics of this step (reward/mean, time/rollout, ...), logged in the step's row."""

    def check(self) -> None:
        if not self.micro_batches:
            raise ValueError("an RLBatch needs at least one micro-batch")
        for mb in self.micro_batches:
            mb.check()


@dataclass(frozen=True)
class PairMicroBatch:
    """One micro-batch of preference pairs: both sides of each pair packed into the same row as
    two documents (chosen, then rejected), so one forward computes both."""

    rows: PackedRows  # loss_mask: True on the response tokens of both sides
    # [B, T] int64: 2p on the chosen side of the micro-batch's pair p, 2p + 1 on its rejected
    # side, -1 on padding
    sequence_ids: Tensor
    num_pairs: int
    # [P, 2] float32, the reference policy's summed logprob of each side's response tokens
    # (chosen, rejected), or None (computed by the step when the loss needs it)
    ref_logps: Optional[Tensor] = None

    def check(self) -> None:
        self.rows.check()
        shape = self.rows.input_ids.shape
        if self.sequence_ids.shape != shape or self.sequence_ids.dtype != torch.int64:
            raise ValueError(
                f"sequence_ids must be int64 of shape {tuple(shape)}, got "
                f"{self.sequence_ids.dtype} {tuple(self.sequence_ids.shape)}"
            )
        targets = host_array(self.sequence_ids)[host_array(self.rows.loss_mask)]
        if (targets < 0).any() or (targets >= 2 * self.num_pairs).any():
            raise ValueError(f"a loss token lies outside the {self.num_pairs} pairs' sequences")
        sides = np.bincount(targets, minlength=2 * self.num_pairs)
        if (sides == 0).any():
            empty = int(np.flatnonzero(sides == 0)[0])
            side = ("chosen", "rejected")[empty % 2]
            raise ValueError(f"pair {empty // 2}: its {side} side has no loss token")
        if self.ref_logps is not None and tuple(self.ref_logps.shape) != (self.num_pairs, 2):
            raise ValueError(
                f"ref_logps has shape {tuple(self.ref_logps.shape)}, expected ({self.num_pairs}, 2)"
            )


@dataclass(frozen=True)
class PairBatch:
    """This rank's share of one preference-optimization step."""

    micro_batches: tuple[PairMicroBatch, ...]
    num_samples: int
    """Pairs in this rank's share (a pair is one sample: the loss is a mean over pairs)."""
    data_after: DataPosition
    """The data position after this step, the same on every rank."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Data-side metrics of this step, logged in the step's row."""

    def check(self) -> None:
        if not self.micro_batches:
            raise ValueError("a PairBatch needs at least one micro-batch")
        for mb in self.micro_batches:
            mb.check()


@dataclass(frozen=True)
class BadToken:
    """A token id outside the model's vocabulary, and where in a batch it is."""

    token_id: int
    micro_batch: int
    row: int
    document: int
    """Which document of the row (its document_ids value; the padding is the last one)."""
    offset: int
    """The token's position in its document."""


def first_bad_token(batch: SftBatch | RLBatch | PairBatch, vocab_size: int) -> Optional[BadToken]:
    """The first token id of `batch` that is not an embedding row, outside [0, vocab_size), or
    None. Pure. One min/max pass over each micro-batch's input_ids: a few microseconds for a
    step's rows, nothing against the step."""
    for m, mb in enumerate(batch.micro_batches):
        rows = mb.rows if isinstance(mb, (RLMicroBatch, PairMicroBatch)) else mb
        ids = rows.input_ids
        if not ids.numel():
            continue
        low, high = torch.aminmax(ids)
        if int(low) >= 0 and int(high) < vocab_size:
            continue
        r, t = ((ids < 0) | (ids >= vocab_size)).nonzero()[0].tolist()
        return BadToken(
            token_id=int(ids[r, t]),
            micro_batch=m,
            row=r,
            document=int(rows.document_ids[r, t]),
            offset=int(rows.position_ids[r, t]),
        )
    return None


def to_device(obj, device: torch.device):
    """A copy of a batch dataclass with every tensor field (nested too) moved to `device`;
    packed rows keep the layout read from their host copy (`row_layout`).

    The copies are non-blocking: a copy from host memory that is not pinned is staged at once
    and queued, without waiting for the device's queue to drain."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Tensor):
            # Non-blocking to a device only: a copy to the host must be complete when read.
            changes[f.name] = value.to(device, non_blocking=device.type != "cpu")
        elif dataclasses.is_dataclass(value):
            changes[f.name] = to_device(value, device)
    moved = dataclasses.replace(obj, **changes)
    if isinstance(obj, PackedRows):
        object.__setattr__(moved, "_layout", row_layout(obj).to(device))
    return moved
