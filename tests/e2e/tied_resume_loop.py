"""Tied embeddings under FSDP2, resume and export: a two-rank job (tests/two_ranks.py) with OUT
MODEL_DIR.

One launch does what two `fnt sft` runs of tests/e2e/test_resume.py do, with the driver's own
pieces (init_state, fold, save_checkpoint_, restore_) and the debug SFT config: N steps
uninterrupted, checkpointing step K and step N under OUT/full/checkpoints, then a fresh state
restored from step K stepped to N, checkpointing under OUT/resumed/checkpoints. Each rank writes
OUT/rank{R}.json: whether the LM head is still the embedding's parameter after sharding and
after training, and each step's loss and grad norm. Rank 0 also saves the trained model's logits
on a probe batch (OUT/logits.pt), gathered through FSDP2's forward, for the export check, and
the trained model is published as external RL publishes it (OUT/published/weights/step_N).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fnt import fold, init_state, restore_, setup_trainer, sft_source, teardown_trainer, to_floats
from fnt.apps.cli import parse_config
from fnt.checkpoint import save_checkpoint_
from fnt.config import RLConfig
from fnt.rollout.publish import publish_weights_
from steps import sft_step

N, K = 4, 2
PROBE = torch.arange(5, 45).reshape(2, 20)


def is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def train(state, steps: int, root: Path, save_at: set[int]):
    """Step `state` `steps` times; checkpoint the steps in save_at under root; the last state
    and each step's (loss, grad norm)."""
    runtime = state.handles.runtime
    history = []
    for state, metrics in fold(state, sft_source, sft_step, steps):
        values = to_floats(metrics)
        history.append([values["loss/mean"], values["optim/grad_norm"]])
        if state.progress.step in save_at:
            save_checkpoint_(
                root,
                state.progress,
                state.handles.model,
                state.handles.optimizer,
                model_name=state.config.model.name,
                rank=runtime.rank,
                distributed=runtime.distributed,
            )
    return state, history


def main(out: str, model_dir: str) -> None:
    out_dir = Path(out)
    argv = ["--config", "examples/debug/sft.toml", "--model.name", model_dir]
    config, _ = parse_config([*argv, "--max-steps", str(N)])
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    report = {"tied_at_start": is_tied(state.handles.model)}
    state, report["full"] = train(state, N, out_dir / "full" / "checkpoints", {K, N})
    report["tied_after_training"] = is_tied(state.handles.model)
    # The weights an external RL run publishes for its rollout engine (a collective).
    publisher = [*argv, "--output-dir", str(out_dir / "published"), "--rollout.engine", "external"]
    publish_weights_(dataclasses.replace(state, config=parse_config(publisher, RLConfig)[0]))
    with torch.no_grad():
        logits = state.handles.model(input_ids=PROBE).logits  # a collective: every rank
    if runtime.is_main:
        torch.save(logits, out_dir / "logits.pt")

    resumed = restore_(init_state(config, runtime), out_dir / "full" / "checkpoints" / f"step_{K}")
    report["resumed_from"] = resumed.progress.step
    _, report["resumed"] = train(resumed, N - K, out_dir / "resumed" / "checkpoints", {N})
    (out_dir / f"rank{runtime.rank}.json").write_text(json.dumps(report))
    teardown_trainer(runtime)
