"""Publishing the policy for the engines whose samplers run outside the trainer (external
orchestrators, vLLM servers). Side effects: gathers the policy (a collective under FSDP2) and
writes {output_dir}/weights/step_N/ as a transaction.

Each published directory is a Hugging Face model directory (or, with LoRA, a PEFT adapter
directory or the merged model: rollout.publish) with the tokenizer, `fnt_published.json`
(`{"kind": "full" | "merged" | "adapter", "step": N}`) and the `COMPLETE` marker written last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fnt.config import RLConfig
from fnt.config.engines import engine_of
from fnt.distributed.collectives import full_state_dict
from fnt.model.loading import without_tied_duplicates
from fnt.model.lora import merge_adapters, save_adapter_
from fnt.model.tokenizer import load_tokenizer
from fnt.state import TrainState
from fnt.store.rundir import WEIGHTS_DIR, prune_steps_, step_dir
from fnt.store.transaction import begin_dir_, commit_dir_

if TYPE_CHECKING:
    from torch import Tensor


def weights_dir(output_dir: str, step: int) -> Path:
    return step_dir(Path(output_dir) / WEIGHTS_DIR, step)


# Written into every published directory: {"kind": "full" | "merged" | "adapter", "step": N}.
PUBLISHED_FILE = "fnt_published.json"


def published_kind(config: RLConfig) -> str:
    """What publish_weights_ writes: "full" (no LoRA), "adapter" (a PEFT adapter directory, the
    default with LoRA for an external orchestrator: a few MB) or "merged" (a full model with the
    adapters merged in; the default for the vLLM engine, whose servers reload full weights): the
    engine's `lora_publish` unless rollout.publish says. Pure."""
    if not config.model.lora.rank:
        return "full"
    publish = config.rollout.publish
    return engine_of(config.rollout).lora_publish if publish == "auto" else publish


def published_weights(state: TrainState, *, cpu_offload: bool) -> Optional[dict[str, Tensor]]:
    """The policy as a Hugging Face state dict, gathered by every rank (a collective under
    FSDP2), LoRA adapters merged in and tied duplicates left out: rank 0's, None elsewhere.
    For a full or merged publish (not an adapter one)."""
    config, model = state.config, state.handles.model
    weights = full_state_dict(model, cpu_offload=cpu_offload)
    if not state.handles.runtime.is_main:
        return None
    if published_kind(config) == "merged":
        weights = merge_adapters(weights, config.model.lora)
    return without_tied_duplicates(model, weights)


def publish_weights_(state: TrainState) -> Optional[Path]:
    """Write the current policy to weights/step_{progress.step}/ as a transaction; keep the newest.

    Every rank takes part in gathering the full state dict (a collective under FSDP2; a LoRA
    adapter publish gathers only the trained weights); rank 0 writes the directory through
    fnt.store.transaction: a Hugging Face model, or a PEFT adapter (`published_kind`, recorded in
    its fnt_published.json), and prunes older complete directories beyond rollout.keep_weights. A
    resumed run republishes the step it resumed from, replacing that directory. Returns the
    directory on rank 0, None elsewhere.
    """
    config, runtime, model = state.config, state.handles.runtime, state.handles.model
    kind = published_kind(config)
    if kind == "adapter":
        weights = full_state_dict(model, cpu_offload=True, trained_only=True)
    else:
        weights = published_weights(state, cpu_offload=True)
    if not runtime.is_main:
        return None
    final = weights_dir(config.output_dir, state.progress.step)
    partial = begin_dir_(final)
    if kind == "adapter":
        save_adapter_(partial, model, weights, config.model.name)
    else:
        model.save_pretrained(partial, state_dict=weights, safe_serialization=True)
    load_tokenizer(config.model.name).save_pretrained(partial)
    record = {"kind": kind, "step": state.progress.step}
    (partial / PUBLISHED_FILE).write_text(json.dumps(record) + "\n")
    commit_dir_(partial, final, f"step {state.progress.step}\n", replace=True)
    prune_steps_(final.parent, config.rollout.keep_weights)
    return final
