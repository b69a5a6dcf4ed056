"""Which checkpoint to resume from, and what a resumed run may change. Pure, apart from listing
one directory.

Only complete checkpoints count (fnt.store.rundir: a directory named `step_N` holding the marker
that the saver writes last), so a crash at any moment of a save leaves the previous complete
checkpoint as the newest one.

Each checkpoint records the config it was written with. `reconcile_config` compares it with the
current one key by key under `RESUME_POLICY`: a change that only affects how the run continues
(the schedule, max_steps, logging, checkpointing, parallelism) is used; a change that makes the
checkpoint belong to another run (seed, data, batch shape, model) is refused unless
`resume_force` (`--resume.force`); the optimizer's hyperparameters are used and set on its
parameter groups after its state is loaded, which would otherwise restore the saved ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from fnt.config.loading import canonical_value
from fnt.config.schema import flatten
from fnt.errors import ConfigError
from fnt.store.rundir import complete_steps, list_step_dirs


class ResumeError(ConfigError):
    """The requested checkpoint does not exist or is incomplete (a bad `resume` value)."""


def choose_resume_step(resume: Union[int, bool, str, None], steps: list[int]) -> Optional[int]:
    """The resume decision over the complete steps found. Pure.

    None/False -> None (start fresh); "latest"/True -> the highest step, or None when there is
    none; an int N -> N if step_N is complete, else ResumeError listing what exists.
    """
    if resume is None or resume is False:
        return None
    if resume is True or resume == "latest":
        return max(steps) if steps else None
    if isinstance(resume, int):
        if resume in steps:
            return resume
        found = ", ".join(str(s) for s in steps) if steps else "none"
        raise ResumeError(
            f"resume = {resume}: no complete checkpoint step_{resume}; "
            f"complete steps found: {found}"
        )
    raise ResumeError(f'resume = {resume!r}: expected none, "latest", true/false or a step number')


def resolve_resume_step(
    resume: Union[int, bool, str, None], ckpt_root: Union[str, Path]
) -> Optional[int]:
    """The step to resume from given the `resume` setting and the checkpoint root directory."""
    return choose_resume_step(resume, complete_steps(list_step_dirs(ckpt_root)))


# ---------------------------------------------------------------------------------------------
# Reconciling the checkpoint's config with the current one

# What a resume does when a key differs from the value the checkpoint was written with.
MAY_CHANGE = "may change"
OPTIMIZER = "optimizer"
FIXED = "fixed"
LAUNCH = "launch"

Policy = Literal["may change", "optimizer", "fixed", "launch"]

POLICY_MEANINGS: dict[Policy, str] = {
    FIXED: "refused (exit 2) unless `--resume.force`: the checkpoint belongs to a run with the "
    "old value, and the resumed run would be neither that run nor a fresh one",
    OPTIMIZER: "the new value is used; it is set on the optimizer after the optimizer's state is "
    "loaded (loading restores the saved value)",
    MAY_CHANGE: "the new value is used: the key shapes how the run goes on, not what it continues",
    LAUNCH: "not compared: the key says how this launch starts",
}

# Every key of the schema (RLConfig, which includes Config's, and DPOConfig's dpo section),
# decided one by one; a test fails when a key is added to the schema without a line here.
RESUME_POLICY: dict[str, Policy] = {
    "output_dir": MAY_CHANGE,  # a run directory that was moved or copied
    "seed": FIXED,  # data order, synthetic data and RL sampling seeds derive from it
    "max_steps": MAY_CHANGE,
    "max_epochs": MAY_CHANGE,  # unchanged, the recorded max_steps is kept; changed, re-resolved
    "batch_size": FIXED,  # the data position and the loss normalisation are per batch
    "micro_batch_size": MAY_CHANGE,  # accumulation gives the same update
    "seq_len": FIXED,  # the packing of every row, and so the data position
    "resume": LAUNCH,
    "resume_force": LAUNCH,
    "trace_path": MAY_CHANGE,
    "trace_steps": MAY_CHANGE,
    "model.name": FIXED,
    "model.revision": MAY_CHANGE,  # a Hub id's snapshot is what model.name records, and compares
    "model.dtype": FIXED,  # loading float32 weights into lower-precision parameters rounds them
    "model.compute_dtype": MAY_CHANGE,  # checkpoints stay float32
    "model.ac": MAY_CHANGE,
    "model.compile": MAY_CHANGE,  # the same math; results agree within float rounding
    "model.attn_implementation": MAY_CHANGE,
    "model.loss_chunk_tokens": MAY_CHANGE,
    "model.loss_kernel": MAY_CHANGE,  # the same math; results agree within float rounding
    "model.lora.rank": FIXED,  # the adapters' shapes, and which parameters a checkpoint holds
    "model.lora.alpha": FIXED,  # scales every adapter's update: another model
    "model.lora.dropout": MAY_CHANGE,
    "model.lora.target_modules": FIXED,  # which adapters exist
    "model.lora.modules_to_save": FIXED,  # which full modules the checkpoint holds
    "optim.name": FIXED,  # the saved optimizer state belongs to the algorithm
    "optim.lr": OPTIMIZER,
    "optim.betas": OPTIMIZER,
    "optim.eps": OPTIMIZER,
    "optim.weight_decay": OPTIMIZER,
    "optim.momentum": OPTIMIZER,
    "optim.max_norm": MAY_CHANGE,
    "optim.impl": MAY_CHANGE,  # checkpoints hold float32 weights and moments whatever the impl
    "optim.offload": MAY_CHANGE,
    "optim.keep_fp32": MAY_CHANGE,
    "optim.offload_dtype": MAY_CHANGE,
    "schedule.kind": MAY_CHANGE,
    "schedule.warmup_steps": MAY_CHANGE,
    "schedule.min_lr": MAY_CHANGE,
    "data.kind": FIXED,
    "data.sources": FIXED,  # the data position counts samples of these sources
    "data.overlong": FIXED,  # changes which samples exist
    "data.on_bad_sample": FIXED,  # changes which samples exist
    "data.shuffle": FIXED,  # changes the sample order
    "data.loss_mask": FIXED,  # which tokens are targets, and so which samples are usable
    "data.train_turns": FIXED,  # how many samples a chat gives
    "data.train_reasoning": FIXED,  # which tokens are targets
    "data.chat_template": FIXED,  # the tokens of every sample
    "data.cache_dir": MAY_CHANGE,  # where tokenized data is kept, not what it is
    "val.sources": MAY_CHANGE,  # validation reads, never trains
    "val.prompts": MAY_CHANGE,
    "val.interval": MAY_CHANGE,
    "val.eval_on_start": MAY_CHANGE,
    "val.samples": MAY_CHANGE,
    "ckpt.interval": MAY_CHANGE,
    "ckpt.keep_last": MAY_CHANGE,
    "ckpt.keep_best": MAY_CHANGE,  # the best is found again from the rows on disk
    "ckpt.save_final": MAY_CHANGE,
    "ckpt.verify": MAY_CHANGE,
    "parallel.dp_replicate": MAY_CHANGE,  # checkpoints reshard to any rank count
    "parallel.dp_shard": MAY_CHANGE,
    "parallel.cp": MAY_CHANGE,
    "parallel.tp": MAY_CHANGE,
    "parallel.ep": MAY_CHANGE,
    "wandb.mode": MAY_CHANGE,
    "wandb.project": MAY_CHANGE,
    "wandb.name": MAY_CHANGE,
    "wandb.timeout_s": MAY_CHANGE,
    "wandb.finish_timeout_s": MAY_CHANGE,
    "monitors": MAY_CHANGE,
    "runtime.num_threads": MAY_CHANGE,
    "runtime.matmul_precision": MAY_CHANGE,
    "runtime.dist_timeout_s": MAY_CHANGE,
    "runtime.peak_tflops": MAY_CHANGE,
    "runtime.preempt_exit_code": MAY_CHANGE,
    "runtime.preempt_grace_s": MAY_CHANGE,
    "loss.eps_low": MAY_CHANGE,
    "loss.eps_high": MAY_CHANGE,
    "loss.kind": MAY_CHANGE,  # the loss shapes the updates to come, not the saved state
    "loss.aggregation": MAY_CHANGE,
    "loss.custom": MAY_CHANGE,
    "loss.dppo_mask_low": MAY_CHANGE,
    "loss.dppo_mask_high": MAY_CHANGE,
    "loss.ipo_threshold": MAY_CHANGE,
    "loss.gspo_eps_low": MAY_CHANGE,
    "loss.gspo_eps_high": MAY_CHANGE,
    "loss.kl_tau": MAY_CHANGE,
    "loss.ref_kl_tau": MAY_CHANGE,
    "loss.ref_model": MAY_CHANGE,  # rebuilt from its directory at every start
    "loss.ref_source": MAY_CHANGE,
    "loss.is_correction": MAY_CHANGE,  # as loss.kind: it shapes the updates to come
    "loss.is_level": MAY_CHANGE,
    "loss.is_cap": MAY_CHANGE,
    "loss.is_bounds": MAY_CHANGE,
    "rollout.engine": FIXED,  # where the batches come from
    "rollout.prompts": FIXED,  # the data
    "rollout.prompts_per_step": FIXED,  # the batch
    "rollout.group_size": FIXED,  # the batch
    "rollout.max_new_tokens": MAY_CHANGE,
    "rollout.temperature": MAY_CHANGE,
    "rollout.reward": MAY_CHANGE,
    "rollout.environment": MAY_CHANGE,  # like the reward: the task's rules
    "rollout.environment_args": MAY_CHANGE,  # like the environment: the task's rules
    "rollout.environments": FIXED,  # its members and weights order the prompts: the data
    # Where the environment runs: a healthy pool or server answers as the environment in process.
    "rollout.isolation.workers": MAY_CHANGE,
    "rollout.isolation.timeout_s": MAY_CHANGE,
    "rollout.isolation.memory_mb": MAY_CHANGE,
    "rollout.isolation.failure_reward": MAY_CHANGE,  # like the reward: the task's rules
    "rollout.max_turns": MAY_CHANGE,
    "rollout.lockstep": MAY_CHANGE,  # when turns are sampled, not what they draw from
    "rollout.env_concurrency": MAY_CHANGE,
    "rollout.max_episode_tokens": MAY_CHANGE,
    "rollout.on_truncated": MAY_CHANGE,
    "rollout.tool_parser": MAY_CHANGE,  # like the environment: how turns are read
    "rollout.reasoning_parser": MAY_CHANGE,
    "rollout.std_normalize": MAY_CHANGE,
    "rollout.credit": MAY_CHANGE,  # like std_normalize: how later steps' advantages are made
    "rollout.turn_discount": MAY_CHANGE,
    "rollout.timeout_s": MAY_CHANGE,
    "rollout.keep_weights": MAY_CHANGE,
    "rollout.on_bad_reward": MAY_CHANGE,
    "rollout.async_level": FIXED,  # which policy sampled each step's rollouts
    # The prompt position is recorded, so a resumed run continues the stream with either value.
    "rollout.filter_groups": MAY_CHANGE,
    "rollout.filter_max_rounds": MAY_CHANGE,
    "rollout.publish": MAY_CHANGE,  # how the policy is written for the orchestrator
    "rollout.log_samples_every": MAY_CHANGE,  # what is shown, not what is trained
    "rollout.vllm.urls": MAY_CHANGE,  # a resumed run may use other servers
    "rollout.vllm.model": MAY_CHANGE,
    "rollout.vllm.top_p": MAY_CHANGE,
    "rollout.vllm.startup_timeout_s": MAY_CHANGE,
    "rollout.vllm.retry_s": MAY_CHANGE,
    "rollout.vllm.gpu_memory_utilization": MAY_CHANGE,
    "rollout.vllm.kv_cache_gb": MAY_CHANGE,
    "rollout.vllm.weight_transfer": MAY_CHANGE,  # how the policy reaches the servers
    "rollout.vllm.nccl_address": MAY_CHANGE,
    "rollout.vllm.nccl_port": MAY_CHANGE,
    # reasoning-gym's prompts are the data: the position indexes the generated prompts.
    "rollout.reasoning_gym.tasks": FIXED,
    "rollout.reasoning_gym.seed": FIXED,
    "rollout.reasoning_gym.size": FIXED,
    "rollout.reasoning_gym.val_size": MAY_CHANGE,  # validation reads, never trains
    "rollout.reasoning_gym.answer": FIXED,  # it sets the default system prompt, so the prompts
    "rollout.reasoning_gym.system_prompt": FIXED,
    "dpo.loss": MAY_CHANGE,  # as loss.kind: the loss shapes the updates to come
    "dpo.beta": MAY_CHANGE,
    "dpo.label_smoothing": MAY_CHANGE,
    "dpo.simpo_gamma": MAY_CHANGE,
    "dpo.custom": MAY_CHANGE,
    "dpo.ref_model": MAY_CHANGE,  # as loss.ref_model: rebuilt (or recomputed) at every start
    "dpo.precompute_reference": MAY_CHANGE,  # the same reference, computed before or during
}


@dataclass(frozen=True)
class Decision:
    """What a resume does with one config key.

    `action` is "keep" (nothing to reconcile: the value is the same, the checkpoint does not
    record the key, or the key only describes this launch), "override" (the new value is used)
    or "refuse". `forced` marks an override of a fixed key that resume_force allowed.
    """

    action: Literal["keep", "override", "refuse"]
    old: Any
    new: Any
    forced: bool = False


_ABSENT = object()


def reconcile_config(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, force: bool = False
) -> dict[str, Decision]:
    """Per key of `current`, what resuming a checkpoint written with `saved` does. Pure.

    Both are plain nested dicts (`to_plain(config)`, or the checkpoint's config.json). A key
    the checkpoint does not record (it was written before the key existed) is kept. Every key
    of `current` must have a policy in RESUME_POLICY (KeyError otherwise).
    """
    old_values = {k: canonical_value(k, v) for k, v in flatten(dict(saved)).items()}
    new_values = flatten(dict(current))
    decisions = {}
    for key, new in new_values.items():
        policy = RESUME_POLICY[key]
        old = old_values.get(key, _ABSENT)
        if old is _ABSENT or policy == LAUNCH or old == new:
            decisions[key] = Decision("keep", None if old is _ABSENT else old, new)
        elif policy == FIXED and not force:
            decisions[key] = Decision("refuse", old, new)
        else:
            decisions[key] = Decision("override", old, new, forced=policy == FIXED)
    return decisions


def _value(value: Any) -> str:
    return json.dumps(value)


def refusal(decisions: Mapping[str, Decision], checkpoint: Union[str, Path]) -> Optional[str]:
    """The one-line error for the refused keys (`key: old -> new` each), or None. Pure."""
    refused = [
        f"{k}: {_value(d.old)} -> {_value(d.new)}"
        for k, d in decisions.items()
        if d.action == "refuse"
    ]
    if not refused:
        return None
    return (
        f"resume from {checkpoint}: these keys differ from the config it was written with, and "
        f"the checkpoint belongs to a run with the old values: {'; '.join(refused)}. "
        "Set them back, or pass --resume.force to continue with the new values"
    )


def override_lines(decisions: Mapping[str, Decision]) -> list[str]:
    """One console line per overridden key, saying the new value is used. Pure."""
    return [
        f"resume: {k}: {_value(d.old)} -> {_value(d.new)}"
        + (" (a fixed key, forced by --resume.force)" if d.forced else "")
        for k, d in decisions.items()
        if d.action == "override"
    ]
