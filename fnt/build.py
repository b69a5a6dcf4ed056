"""The first TrainState of a run, saving one as a checkpoint and restoring one from it. Side
effects: loads the model (and shards it under torchrun; so too an RL reference model when the
loss needs one), creates the optimizer state, reads the data or prompts and the held-out data;
`save_state_` writes a checkpoint and `restore_` loads one into the state's model, optimizer
and source handles.

This is where the sources' handles are chosen and built (`source_handles`, by the builder the
config's mode names in fnt.config.modes.MODES), so it is the one core module that imports their
implementations, each only when the config asks for it.

None of these decides anything about resuming: `init_state` never looks at checkpoints, and
`restore_` loads the one it is given. Which checkpoint (if any) a run continues from is the
driver's decision (fnt.start).
"""

from __future__ import annotations

import dataclasses
from functools import partial as bind
from pathlib import Path
from typing import Any, Callable, Optional, Union

from fnt.checkpoint import load_checkpoint_, read_components, save_checkpoint_
from fnt.config import Config, DPOConfig, LoraConfig, RLConfig, engine_of, mode_of
from fnt.config.environments import has_prompts
from fnt.config.modes import has_val_data, reference_dir
from fnt.config.references import import_function
from fnt.distributed.runtime import Runtime
from fnt.model.loading import load_model
from fnt.obs.console import say
from fnt.optim.setup import set_hyperparameters_, setup_optimizer
from fnt.state import Handles, Progress, StepCursor, TrainState
from fnt.store.rundir import DATA_CACHE_DIR, ckpt_root


def source_handles(config: Config, runtime: Runtime, announce: bool = False) -> dict[str, Any]:
    """What the configured batch source reads from, built once by the config's mode
    (fnt.config.modes: `handles`): the RL rollout engine rollout.engine names
    (fnt.config.engines), the tokenized corpus of data.sources, its pairs, or the synthetic
    rows; nothing for RL batches the caller makes itself (an engine that samples
    rollout.prompts, with none named). `announce` shows the tokenization's progress and the
    data's notes (the driver's rank 0; a research loop stays quiet)."""
    return import_function(mode_of(config).handles, 3)(config, runtime, announce)


def rollout_handles(config: RLConfig, runtime: Runtime, announce: bool = False) -> dict[str, Any]:
    """An RL run's source handle: `rollouts`, the engine rollout.engine names, built as
    cls(config, runtime); nothing for an engine that samples rollout.prompts when none are
    named (a research loop that makes its RL batches itself)."""
    engine = engine_of(config.rollout)
    if engine.samples_prompts and not has_prompts(config.rollout):
        return {}
    return {"rollouts": import_function(engine.build, 2)(config, runtime)}


def sample_handles(config: Config, runtime: Runtime, announce: bool = False) -> dict[str, Any]:
    """An SFT run's source handle: `data`, the synthetic rows or the tokenized corpus of
    data.sources (its notes printed when `announce`)."""
    if config.data.kind == "synthetic":
        return synthetic_handles(config, runtime)
    if config.data.kind == "sources":
        from fnt.data.sft import load_source_data
        from fnt.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.model.name)
        data = load_source_data(
            config.data,
            tokenizer,
            seed=config.seed,
            seq_len=config.seq_len,
            progress=announce,
            cache=data_cache(config, runtime),
            **batch_layout(config, runtime),
        )
        if announce:
            for note in data.corpus.notes:
                print(note, flush=True)
        return {"data": data}
    raise ValueError(f"unknown data.kind {config.data.kind!r}")


def pair_handles(config: DPOConfig, runtime: Runtime, announce: bool = False) -> dict[str, Any]:
    """A DPO run's source handle: `data`, the tokenized pairs of data.sources (or the
    synthetic rows)."""
    if config.data.kind == "synthetic":
        return synthetic_handles(config, runtime)
    from fnt.data.pairs import load_pair_data
    from fnt.model.tokenizer import load_tokenizer

    pairs = load_pair_data(
        config.data,
        load_tokenizer(config.model.name),
        seed=config.seed,
        seq_len=config.seq_len,
        progress=announce,
        cache=data_cache(config, runtime),
        **batch_layout(config, runtime),
    )
    return {"data": pairs}


def synthetic_handles(config: Config, runtime: Runtime) -> dict[str, Any]:
    """`data`: the synthetic counting rows of data.kind = "synthetic"."""
    from fnt.data.synthetic import SyntheticData

    layout = batch_layout(config, runtime)
    return {"data": SyntheticData(seed=config.seed, seq_len=config.seq_len, **layout)}


def batch_layout(config: Config, runtime: Runtime) -> dict[str, int]:
    """The batch's split over this rank, as the data handles take it. Pure."""
    return dict(
        batch_size=config.batch_size,
        micro_batch_size=config.micro_batch_size,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dims.dp,
    )


def eval_data(config: Config) -> Optional[Any]:
    """The state's `val` handle: the held-out data its mode loads (fnt.config.modes:
    `eval_data`), or None when the config has none. DataError for a bad file or line."""
    if not has_val_data(config):
        return None
    return import_function(mode_of(config).eval_data, 1)(config)


def policy_publisher(config: Config) -> Optional[Callable[[TrainState], Any]]:
    """What the driver calls with every state it reaches so that the rollout engine's samplers
    get the policy (fnt.config.engines: `publish`), or None."""
    if not mode_of(config).rollouts or not engine_of(config.rollout).publish:
        return None
    return import_function(engine_of(config.rollout).publish, 1)


def data_cache(config: Config, runtime: Runtime):
    """The cache of tokenized sources (fnt.data.cache): data.cache_dir, or the run's own
    data_cache/; its work split over the ranks, which gather what they found over the process
    group."""
    from fnt.data.cache import DataCache
    from fnt.distributed.collectives import all_gather_objects

    directory = Path(config.data.cache_dir or Path(config.output_dir) / DATA_CACHE_DIR)
    return DataCache(
        directory,
        rank=runtime.rank,
        world_size=runtime.world_size,
        gather=bind(all_gather_objects, distributed=runtime.distributed),
    )


def reference_model(config: Config, runtime: Runtime, policy: Any) -> Any:
    """The frozen reference policy of an RL run whose loss needs one (loss.ref_kl_tau > 0 with
    loss.ref_source = "model"), or of a DPO run whose loss reads reference logprobs that were
    not precomputed (`dpo_reference`), else None.

    With LoRA (model.lora.rank > 0) and loss.ref_model empty, it is `policy` itself: the base
    model is the reference, and steps.rl computes it with the adapters switched off
    (fnt.model.lora.adapters_disabled), so no second model is in memory. Otherwise it is loaded from
    loss.ref_model (default model.name, the starting policy) and sharded exactly like the policy
    (FSDP2 under torchrun, the same dtypes and kernel), then frozen: no parameter requires a
    gradient, it is in no optimizer, and checkpoints do not hold it, so a resumed run rebuilds
    it from its directory, as an uninterrupted one has it.
    """
    if mode_of(config).reference(config) != "model":
        return None
    return frozen_reference(config, runtime, policy, reference_dir(config))


def frozen_reference(config: Config, runtime: Runtime, policy: Any, ref_model: str) -> Any:
    """The reference policy in directory `ref_model` (empty: model.name): `policy` itself with
    LoRA and no ref_model (its base is the reference), else loaded and sharded like the policy
    and frozen (no gradients, no optimizer)."""
    if config.model.lora.rank and not ref_model:
        return policy
    ref_config = dataclasses.replace(
        config.model, name=ref_model or config.model.name, ac=False, lora=LoraConfig()
    )
    model = load_model(ref_config, runtime, runtime.offload)
    return model.eval().requires_grad_(False)


def precomputed_references(
    config: Config, runtime: Runtime, policy: Any, handles: dict[str, Any], announce: bool
) -> dict[str, Any]:
    """`handles` with the pair data's and the val pairs' reference tables filled in, for a DPO
    run with dpo.precompute_reference and a loss that reads them (else as they are).

    Called before any checkpoint is loaded, so `policy` is still model.name's weights: with
    LoRA its base (adapters off) and without it the policy itself are the reference, and no
    second model is loaded unless dpo.ref_model names another directory (loaded, used and
    dropped). The tables come from the data cache when it holds them
    (fnt.evaluation.pairs.reference_table)."""
    if mode_of(config).reference(config) != "precomputed":
        return handles
    from fnt.evaluation.pairs import reference_table

    ref_dir = reference_dir(config)
    ref = policy
    if ref_dir and ref_dir != config.model.name:
        ref = frozen_reference(config, runtime, policy, ref_dir)
    say(announce, "precomputing the reference logprobs of the pairs")
    cache_dir = data_cache(config, runtime).directory
    out = dict(handles)
    for name in ("data", "val"):
        data = handles.get(name)
        if data is not None:
            table = reference_table(ref, data.corpus, config, runtime, cache_dir, data.pad_token_id)
            out[name] = dataclasses.replace(data, reference=table)
    return out


def init_state(config: Config, runtime: Runtime, announce: bool = False) -> TrainState:
    """A fresh TrainState at step 0: the model from `config.model.name`, its optimizer, the
    source's handles (and the RL reference model, `reference_model`) and `Progress()`. Reads no
    checkpoint and refuses nothing. `announce` prints each phase as it starts (fnt.obs.console;
    the driver passes it on rank 0)."""
    # The data first: a bad file or prompt should fail before the model is loaded.
    say(announce, "reading the data")
    sources = source_handles(config, runtime, announce)
    val = eval_data(config)
    say(announce, f"loading the model {config.model.name}")
    model = load_model(config.model, runtime, runtime.offload, seed=config.seed)
    say(announce, f"building the optimizer ({config.optim.name})")
    optimizer = setup_optimizer(config.optim, model, runtime.dims, config.model)
    ref_model = reference_model(config, runtime, model)
    sources = precomputed_references(config, runtime, model, {**sources, "val": val}, announce)
    handles = Handles(model, optimizer, runtime, StepCursor(0), ref_model=ref_model, **sources)
    return TrainState(config, Progress(), handles)


def save_state_(state: TrainState) -> Path:
    """Checkpoint `state` as checkpoints/step_{progress.step} of its output_dir: the model, the
    optimizer, Progress, the config and the state of every source handle, as one transaction (a
    collective under torchrun: every rank calls it). Returns the checkpoint's directory."""
    handles = state.handles
    return save_checkpoint_(
        ckpt_root(state.config.output_dir),
        state.progress,
        handles.model,
        handles.optimizer,
        model_name=state.config.model.name,
        rank=handles.runtime.rank,
        distributed=handles.runtime.distributed,
        config=state.config,
        components={name: c.state_dict() for name, c in handles.components().items()},
    )


def restore_(state: TrainState, checkpoint_dir: Union[str, Path]) -> TrainState:
    """Load a complete checkpoint into the state's model, optimizer and source handles (in
    place, a collective under torchrun) and return the restored state, whose Progress is the
    checkpoint's. The optimizer then gets the hyperparameters of `state.config` (loading
    restored the saved ones).

    `state` must be current; afterwards it is consumed, like a state that was stepped.
    """
    state.check_current()
    handles = state.handles
    progress = load_checkpoint_(
        Path(checkpoint_dir),
        handles.model,
        handles.optimizer,
        distributed=handles.runtime.distributed,
    )
    saved = read_components(Path(checkpoint_dir), handles.runtime.device)
    for name, component in handles.components().items():
        component.load_state_dict(saved.get(name, {}))
    set_hyperparameters_(handles.optimizer, state.config.optim)
    handles.cursor.move_(state.progress.step, progress.step)
    return dataclasses.replace(state, progress=progress)
