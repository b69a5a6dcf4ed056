"""Run by test_sharded_load under torchrun: load each model directory the way training does under
torchrun (meta init, FSDP2, per-rank shards from safetensors) and save, on rank 0, the full
weights gathered back and the logits of one forward, to OUT/{i}.pt for the i-th directory.

usage: torchrun --nproc-per-node N sharded_load_check.py OUT MODEL_DIR...
"""

from __future__ import annotations

import resource
import sys

import torch

from fnt.config import Config, ModelConfig
from fnt.distributed.collectives import full_state_dict
from fnt.distributed.runtime import setup_trainer, teardown_trainer
from fnt.model.loading import load_model

INPUT_IDS = torch.arange(3, 43).reshape(2, 20)


def main(out: str, model_dirs: list[str]) -> None:
    runtime = None
    for i, model_dir in enumerate(model_dirs):
        config = Config(model=ModelConfig(name=model_dir), batch_size=2, micro_batch_size=1)
        runtime = runtime or setup_trainer(config)
        model = load_model(config.model, runtime)
        with torch.no_grad():
            logits = model(input_ids=INPUT_IDS).logits
        full = full_state_dict(model)
        if runtime.rank == 0:
            peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            torch.save({"weights": full, "logits": logits, "peak_gib": peak_gib}, f"{out}/{i}.pt")
    teardown_trainer(runtime)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
