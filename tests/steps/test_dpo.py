"""dpo_step and its loss family: each loss kind against a float64 reference, both sides of a pair
in one packed forward equal to each side run alone, accumulation, and the three reference
modes (LoRA base, frozen copy, precomputed) agreeing."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt import fold, init_state
from fnt.config import (
    DataConfig,
    DataSourceConfig,
    DPOConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PreferenceConfig,
)
from fnt.distributed.runtime import setup_trainer
from fnt.model.lm_head import loss_tokens_of
from fnt.preference import PairLogps, pair_logps, with_reference_logps
from fnt.sources import pair_source
from fnt.update import accumulate_gradients_, forward_loss_tokens
from steps import dpo_step
from steps.dpo import dpo_loss
from steps.dpo_losses import LOSSES, loss_of

KINDS = ("sigmoid", "ipo", "simpo", "orpo")


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(kind: str, w, lo, rw, rl, nw, nl, beta, eps, gamma) -> float:
    """The per-pair loss of `kind` in plain float64 Python, from the papers' formulas."""
    if kind == "sigmoid":
        h = beta * ((w - rw) - (lo - rl))
        return -(1 - eps) * logsigmoid(h) - eps * logsigmoid(-h)
    if kind == "ipo":
        h = (w - rw) / nw - (lo - rl) / nl
        return (h - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        h = beta * (w / nw - lo / nl) - gamma
        return -(1 - eps) * logsigmoid(h) - eps * logsigmoid(-h)
    mw, ml = w / nw, lo / nl
    odds = (mw - math.log(1 - math.exp(mw))) - (ml - math.log(1 - math.exp(ml)))
    return -mw - beta * logsigmoid(odds)


def reference_rewards(kind, w, lo, rw, rl, nw, nl, beta) -> tuple[float, float]:
    if kind in ("simpo", "orpo"):
        return beta * w / nw, beta * lo / nl
    if kind == "ipo":
        return beta * (w - rw) / nw, beta * (lo - rl) / nl
    return beta * (w - rw), beta * (lo - rl)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_each_loss_equals_its_float64_formula(kind, eps):
    generator = torch.Generator().manual_seed(7)
    n = 64
    tokens = torch.randint(1, 40, (4, n), generator=generator).double()
    # Mean logprobs in [-6, -0.01], including pairs where the reference prefers either side.
    logps = -torch.rand(4, n, generator=generator, dtype=torch.float64) * 6 * tokens - 0.01
    pairs = PairLogps(logps[0], logps[1], tokens[0], tokens[1], logps[2], logps[3])
    config = PreferenceConfig(loss=kind, beta=0.3, label_smoothing=eps, simpo_gamma=0.4)
    got = LOSSES[kind](pairs, config)
    assert got.dtype == torch.float64 and got.shape == (n,)
    smoothing = eps if kind in ("sigmoid", "simpo") else 0.0
    for i in range(n):
        args = (*(t[i].item() for t in (logps[0], logps[1], logps[2], logps[3])),)
        counts = (tokens[0, i].item(), tokens[1, i].item())
        want = reference_loss(kind, *args, *counts, 0.3, smoothing, 0.4)
        assert got[i].item() == pytest.approx(want, rel=1e-12, abs=1e-12), (kind, i)


def test_the_losses_stay_finite_where_naive_forms_overflow():
    big = torch.tensor([3000.0, -3000.0], dtype=torch.float64)
    one = torch.ones(2, dtype=torch.float64)
    pairs = PairLogps(big, -big, one, one, torch.zeros(2), torch.zeros(2))
    for kind in ("sigmoid", "simpo"):
        assert torch.isfinite(LOSSES[kind](pairs, PreferenceConfig(loss=kind))).all()
    # ORPO near p = 1: log(1 - e^m) for m -> 0- must not cancel to -inf.
    near_one = PairLogps(-torch.tensor([1e-12, 1e-3]), -torch.tensor([2.0, 2.0]), one, one)
    assert torch.isfinite(LOSSES["orpo"](near_one, PreferenceConfig(loss="orpo"))).all()


def write_pairs(path: Path, n: int = 12) -> Path:
    lines = []
    for i in range(n):
        count = 2 + i % 6
        good = " ".join(str(k) for k in range(1, count + 1))
        bad = " ".join(str(k) for k in range(count, 0, -1)) + (" x" * (i % 3))
        prompt = f"count to {count}"
        if i % 2:
            record = {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": good,
                "rejected": [{"role": "assistant", "content": bad}],
            }
        else:
            record = {"prompt": prompt, "chosen": good, "rejected": bad}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def dpo_config(model_dir, tmp_path, *, lora=0, **dpo) -> DPOConfig:
    data = DataConfig(
        kind="sources", sources=(DataSourceConfig(path=str(write_pairs(tmp_path / "p.jsonl"))),)
    )
    return DPOConfig(
        model=ModelConfig(name=str(model_dir), lora=LoraConfig(rank=lora)),
        optim=OptimConfig(lr=3e-3, max_norm=1.0),
        data=data,
        output_dir=str(tmp_path / "run"),
        seq_len=128,
        batch_size=4,
        micro_batch_size=2,
        max_steps=10,
        dpo=PreferenceConfig(**dpo),
    )


def make_state(config):
    return init_state(config, setup_trainer(config))


def side_logps_float64(model, rows, sequence_ids, code) -> tuple[float, int]:
    """The summed logprob of one side's response tokens, the side run alone in float64 with
    the full logits."""
    where = sequence_ids == code
    (row,) = where.any(dim=1).nonzero()[0].tolist()
    ids, mask = rows.input_ids[row][where[row]], rows.loss_mask[row][where[row]]
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return float(logp[mask[1:]].sum()), int(mask[1:].sum())


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_loss_equals_a_float64_reference_of_each_side_alone(
    tiny_model_dir, tiny_reference_dir, tmp_path, kind
):
    ref_dir = "" if kind in ("simpo", "orpo") else str(tiny_reference_dir)
    config = dpo_config(tiny_model_dir, tmp_path, loss=kind, ref_model=ref_dir, beta=0.5)
    state = make_state(config)
    batch = pair_source(state)
    totals = accumulate_gradients_(
        state.handles.model,
        with_reference_logps(state.handles.ref_model, batch, state.handles.runtime, 1024)
        if ref_dir
        else batch,
        state.handles.runtime,
        lambda lp, mb: dpo_loss(lp, mb, config.dpo, loss_of(config.dpo)),
        rows_of=lambda mb: mb.rows,
        per_sample=True,
    )
    policy64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    ref64 = AutoModelForCausalLM.from_pretrained(tiny_reference_dir, dtype=torch.float64)
    losses, margins = [], []
    for mb in batch.micro_batches:
        for p in range(mb.num_pairs):
            (w, nw), (lo, nl) = (
                side_logps_float64(policy64, mb.rows, mb.sequence_ids, 2 * p + s) for s in (0, 1)
            )
            rw, rl = (
                side_logps_float64(ref64, mb.rows, mb.sequence_ids, 2 * p + s)[0] for s in (0, 1)
            )
            losses.append(reference_loss(kind, w, lo, rw, rl, nw, nl, 0.5, 0.0, 0.5))
            chosen, rejected = reference_rewards(kind, w, lo, rw, rl, nw, nl, 0.5)
            margins.append(chosen - rejected)
    assert totals.samples == len(losses) == batch.num_samples
    mean = float(totals.loss_sum) / totals.samples
    assert mean == pytest.approx(sum(losses) / len(losses), rel=1e-5, abs=1e-5)
    got_margin = float(totals.sums["rewards/margins"]) / totals.samples
    assert got_margin == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-5)
    accuracy = float(totals.sums["rewards/accuracies"]) / totals.samples
    assert accuracy == sum(m > 0 for m in margins) / len(margins)


def test_accumulated_micro_batches_give_the_full_batch_gradient(tiny_model_dir, tmp_path):
    config = dpo_config(tiny_model_dir, tmp_path, loss="simpo", beta=2.0)
    state = make_state(config)
    model, runtime = state.handles.model, state.handles.runtime
    batch = pair_source(state)
    assert len(batch.micro_batches) == 2

    def grads(micro_batches):
        model.zero_grad(set_to_none=True)
        merged = dataclasses.replace(batch, micro_batches=micro_batches)
        totals = accumulate_gradients_(
            model,
            merged,
            runtime,
            lambda lp, mb: dpo_loss(lp, mb, config.dpo, loss_of(config.dpo)),
            rows_of=lambda mb: mb.rows,
            per_sample=True,
        )
        return totals, [p.grad.clone() for p in model.parameters()]

    split_totals, split = grads(batch.micro_batches)
    one = merge_micro_batches(batch.micro_batches)
    whole_totals, whole = grads((one,))
    torch.testing.assert_close(split_totals.loss_sum, whole_totals.loss_sum, rtol=0, atol=1e-5)
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def merge_micro_batches(mbs):
    """One micro-batch with the rows of all of `mbs` (their pairs renumbered)."""
    from fnt.batch import PackedRows, PairMicroBatch

    fields = ("input_ids", "position_ids", "document_ids", "loss_mask")
    rows = PackedRows(*(torch.cat([getattr(mb.rows, f) for mb in mbs]) for f in fields))
    offset, ids = 0, []
    for mb in mbs:
        ids.append(torch.where(mb.sequence_ids >= 0, mb.sequence_ids + 2 * offset, -1))
        offset += mb.num_pairs
    return PairMicroBatch(rows, torch.cat(ids), offset)


def test_dpo_learns_to_prefer_the_chosen_side(tiny_model_dir, tmp_path):
    config = dpo_config(tiny_model_dir, tmp_path, loss="sigmoid", beta=0.5)
    state = make_state(config)
    rows = [metrics for state, metrics in fold(state, pair_source, dpo_step, 10)]
    assert float(rows[0]["loss/mean"]) == pytest.approx(math.log(2), abs=1e-6)  # policy == ref
    assert float(rows[0]["rewards/margins"]) == 0.0
    assert float(rows[-1]["loss/mean"]) < 0.9 * math.log(2)
    assert float(rows[-1]["rewards/margins"]) > 0 and float(rows[-1]["rewards/accuracies"]) > 0.5
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert torch.isfinite(torch.as_tensor(rows[-1][key]))


def test_a_loss_of_your_own_and_a_loss_with_the_wrong_shape(tiny_model_dir, tmp_path):
    config = dpo_config(tiny_model_dir, tmp_path)
    state = make_state(config)

    def hinge(pairs, config):
        ref_w, ref_l = pairs.require_reference()
        return torch.relu(1 - config.beta * ((pairs.chosen - ref_w) - (pairs.rejected - ref_l)))

    state, metrics = dpo_step(state, pair_source(state), loss=hinge)
    assert float(metrics["loss/mean"]) == pytest.approx(1.0)  # margin 0 at the start
    with pytest.raises(ValueError, match=r"one value per pair"):
        dpo_step(state, pair_source(state), loss=lambda pairs, config: pairs.chosen.sum())


# The three reference modes ---------------------------------------------------------------------


def reference_of_first_batch(config) -> tuple[list[torch.Tensor], float]:
    """The reference logprobs of each micro-batch of step 1 and the loss of step 1."""
    state = make_state(config)
    batch = pair_source(state)
    if batch.micro_batches[0].ref_logps is None:
        batch = with_reference_logps(state.handles.ref_model, batch, state.handles.runtime, 1024)
    refs = [mb.ref_logps.clone() for mb in batch.micro_batches]
    _, metrics = dpo_step(state, batch)
    return refs, float(metrics["loss/mean"])


def test_lora_base_frozen_copy_and_precomputed_references_agree(tiny_model_dir, tmp_path):
    (tmp_path / "base").mkdir()
    base = dpo_config(tiny_model_dir, tmp_path / "base", lora=4)
    modes = {
        "lora base": base,
        "frozen copy": dataclasses.replace(
            base, dpo=PreferenceConfig(ref_model=str(tiny_model_dir))
        ),
        "precomputed": dataclasses.replace(base, dpo=PreferenceConfig(precompute_reference=True)),
        "precomputed, no LoRA": dataclasses.replace(
            base,
            model=ModelConfig(name=str(tiny_model_dir)),
            dpo=PreferenceConfig(precompute_reference=True),
        ),
        "frozen copy, no LoRA": dataclasses.replace(
            base, model=ModelConfig(name=str(tiny_model_dir))
        ),
    }
    # A run directory each, so that no mode reads another's precomputed table from the cache.
    modes = {
        name: dataclasses.replace(config, output_dir=str(tmp_path / f"run{i}"))
        for i, (name, config) in enumerate(modes.items())
    }
    states = {name: make_state(config) for name, config in modes.items()}
    assert states["lora base"].handles.ref_model is states["lora base"].handles.model
    assert states["frozen copy"].handles.ref_model is not states["frozen copy"].handles.model
    assert states["precomputed"].handles.ref_model is None
    assert states["frozen copy, no LoRA"].handles.ref_model is not None
    results = {name: reference_of_first_batch(config) for name, config in modes.items()}
    want_refs, want_loss = results["lora base"]
    for name, (refs, loss) in results.items():
        for got, want in zip(refs, want_refs):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=name)
        assert loss == pytest.approx(want_loss, abs=1e-6), name


def test_a_precomputed_reference_is_cached_and_read_back(tiny_model_dir, tmp_path):
    config = dpo_config(tiny_model_dir, tmp_path, precompute_reference=True)
    first = make_state(config).handles.data.reference
    entries = list((Path(config.output_dir) / "data_cache").glob("ref-*.pt"))
    assert len(entries) == 1
    torch.save(first * 0 + 7.0, entries[0])  # a planted value shows it is read, not recomputed
    assert torch.equal(make_state(config).handles.data.reference, first * 0 + 7.0)
    # Packed in other rows than training's, the table still matches a step's own reference.
    state = make_state(dataclasses.replace(config, dpo=PreferenceConfig()))
    batch = pair_source(state)
    live = with_reference_logps(state.handles.ref_model, batch, state.handles.runtime, 1024)
    table = first
    for mb, planned in zip(live.micro_batches, pair_source(state).micro_batches):
        assert planned.ref_logps is None
        ids = sorted_pair_ids(state, mb)
        torch.testing.assert_close(mb.ref_logps, table[ids], rtol=0, atol=2e-5)


def sorted_pair_ids(state, mb) -> torch.Tensor:
    """The corpus ids of a micro-batch's pairs, found by their tokens."""
    corpus = state.handles.data.corpus
    ids = []
    for p in range(mb.num_pairs):
        where = mb.sequence_ids == 2 * p
        (row,) = where.any(dim=1).nonzero()[0].tolist()
        tokens = mb.rows.input_ids[row][where[row]]
        ids.append(
            next(q for q in range(corpus.num_samples) if torch.equal(corpus.side(q, 0)[0], tokens))
        )
    return torch.tensor(ids)


def test_packed_sides_equal_each_side_run_alone(tiny_model_dir, tmp_path):
    """Document isolation: the logprobs of a packed micro-batch equal each side's own forward."""
    config = dpo_config(tiny_model_dir, tmp_path, loss="orpo")
    state = make_state(config)
    model = state.handles.model
    mb = pair_source(state).micro_batches[0]
    with torch.no_grad():
        _, logprobs = forward_loss_tokens(model, mb.rows, loss_tokens_of(mb.rows), 1024)
        packed = pair_logps(logprobs, mb)
        for p in range(mb.num_pairs):
            for s, value in enumerate((packed.chosen[p], packed.rejected[p])):
                alone, _ = side_logps_float64(model, mb.rows, mb.sequence_ids, 2 * p + s)
                assert float(value) == pytest.approx(alone, abs=1e-4)
