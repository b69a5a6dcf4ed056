"""LoRA under FSDP2 at two ranks: a two-rank job (tests/two_ranks.py) with OUT MODEL_DIR.

With the debug SFT config and model.lora (rank 8, dropout 0.1): one backward shows where
gradients exist (the adapters only, never the frozen base), then N steps uninterrupted,
checkpointing step K and step N under OUT/full/checkpoints, then a fresh state restored from
step K stepped to N under OUT/resumed/checkpoints. The trained policy is published as external
RL publishes it, once as the adapter (OUT/adapter/weights/step_N) and once merged
(OUT/merged/weights/step_N). Each rank writes OUT/rank{R}.json; rank 0 also saves the trained
model's logits on a probe batch (OUT/logits.pt), for the export checks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fnt import init_state, restore_, setup_trainer, sft_source, teardown_trainer
from fnt.apps.cli import parse_config
from fnt.config import RLConfig
from fnt.rollout.publish import publish_weights_
from fnt.update import accumulate_gradients_
from steps.sft import sft_loss
from tests.e2e.tied_resume_loop import train

N, K = 4, 2
PROBE = torch.arange(5, 45).reshape(2, 20)
LORA = ("--model.lora.rank", "8", "--model.lora.dropout", "0.1")


def where_gradients_are(state) -> dict:
    """One backward of the first batch: which parameters got a gradient; then none again."""
    model = state.handles.model
    accumulate_gradients_(model, sft_source(state), state.handles.runtime, sft_loss)
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    optimized = {id(p) for group in state.handles.optimizer.param_groups for p in group["params"]}
    model.zero_grad(set_to_none=True)
    return {
        "with_grad": sorted(with_grad),
        "trainable": sorted(trainable),
        "frozen": sum(1 for p in model.parameters() if not p.requires_grad),
        "optimized_are_trainable": optimized
        == {id(p) for p in model.parameters() if p.requires_grad},
        "optimizer_state_of_frozen": sum(
            1
            for p in model.parameters()
            if not p.requires_grad and p in state.handles.optimizer.state
        ),
    }


def main(out: str, model_dir: str) -> None:
    out_dir = Path(out)
    argv = ["--config", "examples/debug/sft.toml", "--model.name", model_dir, *LORA]
    config, _ = parse_config([*argv, "--max-steps", str(N)])
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    report = where_gradients_are(state)
    state, report["full"] = train(state, N, out_dir / "full" / "checkpoints", {K, N})
    for kind in ("adapter", "merged"):
        publisher = [*argv, "--output-dir", str(out_dir / kind), "--rollout.engine", "external"]
        rl_config = parse_config([*publisher, "--rollout.publish", kind], RLConfig)[0]
        publish_weights_(dataclasses.replace(state, config=rl_config))
    state.handles.model.eval()  # no dropout: the logits of the trained model
    with torch.no_grad():
        logits = state.handles.model(input_ids=PROBE).logits  # a collective: every rank
    if runtime.is_main:
        torch.save(logits, out_dir / "logits.pt")

    resumed = restore_(init_state(config, runtime), out_dir / "full" / "checkpoints" / f"step_{K}")
    report["resumed_from"] = resumed.progress.step
    _, report["resumed"] = train(resumed, N - K, out_dir / "resumed" / "checkpoints", {N})
    (out_dir / f"rank{runtime.rank}.json").write_text(json.dumps(report))
    teardown_trainer(runtime)
