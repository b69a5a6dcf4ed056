"""model.compile under FSDP2: a two-rank job (tests/two_ranks.py) with OUT MODEL_DIR.

The debug SFT config for STEPS steps on two ranks, eager and then with model.compile (each
decoder layer compiled before fully_shard, fnt.model.loading). Each rank writes OUT/rank{R}.json:
per side, each step's loss and grad norm, the model's state-dict names with their global
shapes, and whether every decoder layer is compiled and an FSDP2 unit.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.fsdp import FSDPModule

from fnt import fold, init_state, setup_trainer, sft_source, teardown_trainer, to_floats
from fnt.apps.cli import parse_config
from fnt.model.compile import is_compiled
from fnt.model.loading import decoder_layers
from steps import sft_step

STEPS = 3


def side(argv: list[str]) -> dict:
    """One run of the config `argv` on this rank: what rank{R}.json records of it."""
    config, _ = parse_config(argv)
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    model = state.handles.model
    layers = decoder_layers(model)
    report = {
        "names": [[name, list(t.shape)] for name, t in model.state_dict().items()],
        "compiled": all(is_compiled(layer) for layer in layers),
        "sharded": all(isinstance(layer, FSDPModule) for layer in layers),
        "steps": [],
    }
    for _, metrics in fold(state, sft_source, sft_step, STEPS):
        values = to_floats(metrics)
        report["steps"].append([values["loss/mean"], values["optim/grad_norm"]])
    teardown_trainer(runtime)
    report["rank"] = runtime.rank
    return report


def main(out: str, model_dir: str) -> None:
    out_dir = Path(out)
    argv = ["--config", "examples/debug/sft.toml", "--model.name", model_dir]
    argv += ["--max-steps", str(STEPS), "--ckpt.save-final", "false"]
    report = {
        "eager": side([*argv, "--output-dir", str(out_dir / "eager")]),
        "compiled": side([*argv, "--output-dir", str(out_dir / "compiled"), "--model.compile"]),
    }
    rank = report["eager"]["rank"]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
