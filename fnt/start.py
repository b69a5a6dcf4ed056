"""The state a run starts from. Side effects: reads the run directory, loads the start state
(fnt.build), prints, and on rank 0 moves an abandoned trajectory aside and prunes checkpoints.

Until rank 0 first changes what the directory held (`start_changing`, before a move or a
prune), a failure leaves it as it was (fnt.store.failed_start).

The decisions are fnt.resume's (`resolve_resume_step`, `reconcile_config`); this module acts on
them: a fresh start refuses a directory that already holds another run's checkpoints or RL
files, a resume first reconciles the config with the checkpoint's, and a run that starts at
step N forks there (`abandon_newer_`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

from fnt.build import init_state, restore_
from fnt.checkpoint import checkpoint_problems, read_meta, read_saved_config
from fnt.config import Config, ConfigError, mode_of, to_plain
from fnt.distributed.runtime import Runtime
from fnt.errors import CheckpointError
from fnt.model.attention import KERNELS, kernel_problem, resolve_kernel
from fnt.model.compile import compiles
from fnt.model.lm_head import resolve_loss_kernel
from fnt.model.loading import compute_dtype_of
from fnt.model.lora import base_fingerprint
from fnt.obs.console import kernels_text, ranks_text, rl_summary, say, start_summary
from fnt.resume import override_lines, reconcile_config, refusal, resolve_resume_step
from fnt.state import TrainState
from fnt.store.best import prune_checkpoints_
from fnt.store.rundir import (
    CHECKSUMS_FILE,
    ROLLOUTS_DIR,
    WEIGHTS_DIR,
    abandon_newer_,
    ckpt_root,
    complete_steps,
    list_step_dirs,
    move_aside_,
    prune_abandoned_,
    run_steps,
    start_changing,
    step_dir,
    step_name,
)
from fnt.store.samples import drop_samples_after_


def start_state(config: Config, runtime: Runtime) -> TrainState:
    """The state a run starts from: restored from the checkpoint `config.resume` selects, or
    fresh, in which case an earlier run's checkpoints, rollouts and weights in the output
    directory are refused.

    Before anything is built, a resume reconciles the config with the checkpoint's
    (`reconcile_with_checkpoint`). Once the start state is loaded, rank 0 moves newer
    checkpoints and published weights, and unfinished saves of either, aside (`abandon_newer_`):
    the run forks there, and what it writes must not collide with, be deleted in favour of, or
    be mixed with the old trajectory's. It then runs the keep_last cleanup.
    """
    config = with_device_choices(config, runtime.device.type)
    root = ckpt_root(config.output_dir)
    resume_step = resolve_resume_step(config.resume, root)
    if resume_step is not None and config.ckpt.verify:
        resume_step = verified_resume_step(config.resume, root, resume_step, runtime)
        checkpoint = step_dir(root, resume_step)
        if runtime.is_main and not (checkpoint / CHECKSUMS_FILE).is_file():
            print(
                f"resume: {checkpoint} records no checksums (an fnt before them wrote it): "
                "loaded unverified",
                flush=True,
            )
    recorded = None
    if resume_step is None:
        refuse_stale_checkpoints(root)
        refuse_stale_rl_files(Path(config.output_dir))
    else:
        recorded = read_saved_config(step_dir(root, resume_step))
        config = with_recorded_steps(config, recorded)
        reconcile_with_checkpoint(config, step_dir(root, resume_step), runtime.is_main)
    state = init_state(config, runtime, announce=runtime.is_main)
    state = with_resolved_epochs(state, recorded)
    if resume_step is not None:
        state = restore_(state, step_dir(root, resume_step))
    if runtime.is_main:
        start_changing(config.output_dir)  # a failure from here leaves a run's files as they are
        for directory in (root, Path(config.output_dir) / WEIGHTS_DIR):
            for source, target in abandon_newer_(directory, state.progress.step):
                print(
                    f"starting at step {state.progress.step}: moved {source} to {target}",
                    flush=True,
                )
            prune_abandoned_(directory)
        for line in drop_samples_after_(config.output_dir, state.progress.step):
            print(line, flush=True)
        # Also finishes a keep_last delete that a kill interrupted; the best checkpoint stays.
        prune_checkpoints_(config.output_dir, config.ckpt.keep_last, config.ckpt.keep_best)
        for line in start_summary_of(state):
            say(True, line)
    return state


def keeps_recorded_steps(config: Config, recorded: Optional[dict]) -> bool:
    """Whether a run counted in epochs resumes a checkpoint written with the same max_epochs:
    it then keeps the step count that checkpoint recorded, so the schedule and the last step
    are the ones the run started with."""
    return (
        config.max_epochs > 0
        and recorded is not None
        and recorded.get("max_epochs") == config.max_epochs
        and isinstance(recorded.get("max_steps"), int)
    )


def with_device_choices(config: Config, device_type: str) -> Config:
    """`config` with model.attn_implementation, model.compile and model.loss_kernel as
    `device_type` resolves them ("auto" becomes the choice made here), so config.json, every
    checkpoint and the start-up summary record what ran. Pure."""
    model = config.model
    dtype = compute_dtype_of(model)
    kernel = resolve_kernel(model.attn_implementation, device_type, dtype)
    problem = kernel_problem(kernel, device_type, dtype) if kernel in KERNELS else None
    if problem is not None:
        raise ConfigError(
            f"'model.attn_implementation' = {kernel!r} cannot run here: it {problem}; "
            'use "auto" (the fastest kernel that can) or "sdpa"'
        )
    chosen = dataclasses.replace(
        model,
        attn_implementation=kernel,
        compile=compiles(model.compile, device_type, model.ac),
        loss_kernel=resolve_loss_kernel(model.loss_kernel, device_type),
    )
    return dataclasses.replace(config, model=chosen)


def with_recorded_steps(config: Config, recorded: Optional[dict]) -> Config:
    """`config` with the checkpoint's recorded max_steps when it keeps them
    (`keeps_recorded_steps`); else `config`, and a run with max_epochs resolves them again
    from its data (`with_resolved_epochs`)."""
    if keeps_recorded_steps(config, recorded):
        return dataclasses.replace(config, max_steps=recorded["max_steps"])
    return config


def with_resolved_epochs(state: TrainState, recorded: Optional[dict]) -> TrainState:
    """The state whose config's max_steps is the step count of max_epochs passes over its
    data (fnt.data.packing.steps_for_epochs), unless max_epochs is off or a resume keeps the
    recorded count. The resolved count is what config.json and every checkpoint record."""
    config = state.config
    if config.max_epochs == 0 or keeps_recorded_steps(config, recorded):
        return state
    steps = state.handles.components()["data"].steps_for_epochs(config.max_epochs)
    return dataclasses.replace(state, config=dataclasses.replace(config, max_steps=steps))


def start_summary_of(state: TrainState) -> list[str]:
    """fnt.obs.console.start_summary of a start state: its ranks (`ranks_text`), its model's
    parameters, its data sources' samples and tokens (for `data.sources`), its steps; an RL
    run's is its ranks and `rl_summary` (its engine, prompts, group size, reward, async_level)."""
    config, model, runtime = state.config, state.handles.model, state.handles.runtime
    ranks = ranks_text(
        runtime.world_size, runtime.dims.dp_replicate, runtime.dims.dp_shard, runtime.device.type
    )
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = config.model
    kernels = kernels_text(model.attn_implementation, model.compile, model.loss_kernel)
    if mode_of(config).rollouts:
        rollout = config.rollout
        prompts = getattr(state.handles.rollouts, "prompts", None)
        return [
            ranks,
            kernels,
            *rl_summary(
                model=config.model.name,
                parameters=parameters,
                trainable=trainable,
                start_step=state.progress.step,
                max_steps=config.max_steps,
                rollout=rollout,
                prompts=None if prompts is None else len(prompts),
            ),
        ]
    data = state.handles.components().get("data")
    corpus = getattr(data, "corpus", None)
    sources = []
    if corpus is not None:
        first = 0
        for name, size in zip(corpus.source_names, corpus.source_sizes):
            ids = range(first, first + size)
            sources.append(
                {
                    "name": name,
                    "samples": size,
                    "dropped": sum(corpus.fates[i].dropped for i in ids),
                    "tokens": sum(corpus.length(i) for i in ids),
                }
            )
            first += size
    return start_summary(
        parameters=parameters,
        trainable=trainable,
        start_step=state.progress.step,
        max_steps=config.max_steps,
        max_epochs=config.max_epochs,
        ranks=ranks,
        tokens_per_step=config.batch_size * config.seq_len,
        sources=sources,
        kernels=kernels,
    )


def verified_resume_step(
    resume: Union[int, bool, str, None], root: Path, step: int, runtime: Runtime
) -> Optional[int]:
    """The checkpoint to resume from once its files are checked against their checksums
    (`checkpoint_problems`), from `step`, the one `resume` selects.

    `resume = N` on a step_N that fails is a CheckpointError naming the bad files and the newest
    step that verifies. "latest" falls back instead: rank 0 moves each newer checkpoint that
    fails into abandoned/ with one line naming its bad files, then one line names the step the
    run resumes from; when none verifies it is a CheckpointError.
    """
    problems = checkpoint_problems(step_dir(root, step), runtime.distributed)
    if not problems:
        return step
    older = [s for s in reversed(complete_steps(list_step_dirs(root))) if s < step]
    if not (resume is True or resume == "latest"):
        good = next(
            (s for s in older if not checkpoint_problems(step_dir(root, s), runtime.distributed)),
            None,
        )
        raise CheckpointError(
            f"resume = {step}: checkpoint {step_name(step)} fails verification: "
            f"{'; '.join(problems)}; "
            + (
                f"the newest checkpoint that verifies is {step_name(good)} (--resume {good})"
                if good is not None
                else "no older checkpoint verifies"
            )
        )
    failed: list[str] = []
    for candidate in [step, *older]:
        if candidate != step:
            problems = checkpoint_problems(step_dir(root, candidate), runtime.distributed)
        if not problems:
            if runtime.is_main:
                print(
                    f"resume: falling back to {step_name(candidate)}, the newest checkpoint that "
                    f"verifies (moved aside: {', '.join(failed)})",
                    flush=True,
                )
            return candidate
        failed.append(step_name(candidate))
        if runtime.is_main:
            start_changing(root.parent)
            ((_, target),) = move_aside_(root, [step_name(candidate)])
            print(
                f"resume: checkpoint {step_name(candidate)} fails verification: "
                f"{'; '.join(problems)}; "
                f"moved it to {target}",
                flush=True,
            )
    raise CheckpointError(
        f"resume = latest: no checkpoint in {root} verifies (each was moved to its abandoned/ "
        "folder, named above); start afresh without --resume, or resume one by hand"
    )


def reconcile_with_checkpoint(config: Config, checkpoint: Path, is_main: bool) -> None:
    """Compare `config` with the one `checkpoint` was written with (fnt.resume.RESUME_POLICY):
    a ConfigError listing every refused key, else (rank 0) one printed line per overridden key.
    """
    saved = read_saved_config(checkpoint)
    if saved is None:
        if is_main:
            print(
                f"resume: {checkpoint} records no config (an older fnt wrote it): "
                "the current config is used as it is",
                flush=True,
            )
        return
    decisions = reconcile_config(saved, to_plain(config), force=config.resume_force)
    message = refusal(decisions, checkpoint)
    if message is not None:
        raise ConfigError(message)
    if is_main:
        for line in override_lines(decisions):
            print(line, flush=True)
    refuse_another_base(config, checkpoint)


def refuse_another_base(config: Config, checkpoint: Path) -> None:
    """A LoRA checkpoint holds adapters of one base model, which it does not contain: a
    ConfigError when model.name now holds another (its fingerprint, fnt.model.lora.base_fingerprint,
    differs from the one meta.json recorded), unless resume_force."""
    recorded = read_meta(checkpoint).get("base_fingerprint")
    if recorded is None or config.resume_force:
        return
    current = base_fingerprint(config.model.name)
    if current != recorded:
        raise ConfigError(
            f"resume: {checkpoint} holds LoRA adapters of the base model in "
            f"{read_meta(checkpoint)['model_name']} (fingerprint {recorded[:16]}), but "
            f"'model.name' = {config.model.name!r} now holds another one (its config.json or "
            f"weights' index differ: fingerprint {current[:16]}). Put the original base back, or "
            "start a new run (resume_force = true resumes anyway)"
        )


def refuse_stale_checkpoints(root: Path) -> None:
    """A fresh start must not mix with an earlier run's checkpoints in the same directory."""
    steps = complete_steps(list_step_dirs(root))
    if steps:
        raise ConfigError(
            f"{root} already holds checkpoints of an earlier run "
            f"(steps {', '.join(map(str, steps))}): "
            "pass --resume latest to continue it, or choose a new output_dir"
        )


def refuse_stale_rl_files(output_dir: Path) -> None:
    """A fresh start must not train on an earlier run's rollouts, nor publish its weights among
    that run's: refuse an output_dir whose rollouts/ or weights/ hold step directories."""
    found = {
        name: steps
        for name in (ROLLOUTS_DIR, WEIGHTS_DIR)
        if (steps := run_steps(list_step_dirs(output_dir / name)))
    }
    if found:
        listed = "; ".join(
            f"{output_dir / name} (steps {', '.join(map(str, steps))})"
            for name, steps in found.items()
        )
        raise ConfigError(
            f"a fresh start, but {listed} hold files of an earlier RL run, which this run would "
            "read as its own: remove or move them, or choose a new output_dir"
        )
