"""Cross-field validation of a built config: values, several fields, the world size. Pure,
except that it imports the user modules a config names for `monitors`, `loss.custom` and
`dpo.custom` (fnt.config.references.require_function: each must name a function of the right
shape), and asks whether each data source's path is a directory (for its metric name,
fnt.config.schema.source_name).

The parallel plan is checked here with the same rules as at setup (fnt.config.parallel), so a plan
that cannot run is rejected on the command line before fnt imports torch. A module the config
names is imported here, though, and may import torch itself (a custom loss usually does).
"""

from __future__ import annotations

import math
from typing import Any

from fnt.config.engines import ENGINES, engine_of
from fnt.config.environments import environment_kind, has_prompts
from fnt.config.modes import has_val_data, held_out_prompts, mode_of
from fnt.config.modes import validate_rollout as validate_rollout  # its old home: still importable
from fnt.config.parallel import batch_layout_problem, plan_parallel_dims
from fnt.config.references import require_function
from fnt.config.schema import (
    CHAT_ROLES,
    Config,
    DataSourceConfig,
    keep_best_rule,
    repeated_source_names,
    source_name,
)
from fnt.errors import ConfigError


def validate(config: Config, world_size: int) -> None:  # noqa: C901 - a flat list of rules
    """Rules that involve values, several fields or the world size; raises ConfigError."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'{key}' = {_get(config, key)!r}: {message}")

    require(config.max_steps >= 1, "max_steps", "must be at least 1")
    validate_epochs(config)
    require(config.batch_size >= 1, "batch_size", "must be at least 1")
    require(config.micro_batch_size >= 1, "micro_batch_size", "must be at least 1")
    require(config.seq_len >= 2, "seq_len", "must be at least 2")
    require(config.trace_steps >= 0, "trace_steps", "must be 0 (all steps) or more")
    for i, name in enumerate(config.monitors):
        require_function(
            name,
            f"monitors[{i}]",
            2,
            "a class built as Class(config, start_step) with log(row) and close() "
            "(fnt.obs.monitors)",
        )
    require(config.optim.lr >= 0, "optim.lr", "must be >= 0")
    require(config.optim.eps > 0, "optim.eps", "must be > 0")
    require(config.optim.max_norm >= 0, "optim.max_norm", "must be >= 0 (0 measures only)")
    require(config.optim.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    require(all(0 <= b < 1 for b in config.optim.betas), "optim.betas", "each must be in [0, 1)")
    require(config.schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0")
    require(config.schedule.min_lr >= 0, "schedule.min_lr", "must be >= 0")
    require(
        config.schedule.min_lr <= config.optim.lr,
        "schedule.min_lr",
        f"must not exceed optim.lr = {config.optim.lr}",
    )
    require(
        not (config.model.compile is True and config.model.ac),
        "model.compile",
        "not with model.ac: torch.compile cannot trace transformers' checkpointed decoder layers "
        "(they would run eagerly); turn one of them off",
    )
    require(config.ckpt.interval >= 0, "ckpt.interval", "must be >= 0 (0 = final step only)")
    require(config.ckpt.keep_last >= 0, "ckpt.keep_last", "must be >= 0 (0 = keep all)")
    validate_keep_best(config)
    require(config.runtime.num_threads >= 0, "runtime.num_threads", "must be >= 0 (0 = auto)")
    require(config.runtime.dist_timeout_s > 0, "runtime.dist_timeout_s", "must be > 0")
    require(config.runtime.peak_tflops >= 0, "runtime.peak_tflops", "must be >= 0 (0 = auto)")
    require(
        1 <= config.runtime.preempt_exit_code <= 255,
        "runtime.preempt_exit_code",
        "must be an exit status from 1 to 255",
    )
    require(config.wandb.timeout_s > 0, "wandb.timeout_s", "must be > 0")
    require(config.runtime.preempt_grace_s > 0, "runtime.preempt_grace_s", "must be > 0")
    require(config.wandb.finish_timeout_s > 0, "wandb.finish_timeout_s", "must be > 0")
    require(
        config.model.loss_chunk_tokens >= 0,
        "model.loss_chunk_tokens",
        "must be >= 0 (0 computes all logits at once)",
    )
    require(
        not isinstance(config.resume, int) or isinstance(config.resume, bool) or config.resume >= 0,
        "resume",
        'must be a step number >= 0, "latest", true/false or none',
    )
    if config.data.kind == "sources":
        require(
            bool(config.data.sources),
            "data.sources",
            'data.kind = "sources" needs at least one source',
        )
        validate_sources(config.data.sources, "data.sources")
        require(
            set(config.data.loss_mask) <= set(CHAT_ROLES),
            "data.loss_mask",
            f"roles must be among {CHAT_ROLES}",
        )
    validate_lora(config)
    validate_val(config)
    # ep does not change the data-parallel size; setup checks it against the model.
    dp = plan_parallel_dims(config.parallel, world_size, ep=1).dp
    layout = batch_layout_problem(config.batch_size, config.micro_batch_size, dp)
    require(layout is None, "batch_size", str(layout))
    check = mode_of(config).check
    if check is not None:
        check(config, dp)
    # After the mode's own check, whose message is the more precise one (DPO's "trains on pairs").
    require(
        mode_of(config).rollouts or config.data.kind == "sources" or not config.data.sources,
        "data.kind",
        "would train on synthetic counting sequences and leave the data.sources given unread: "
        'set data.kind = "sources"',
    )


def validate_epochs(config: Config) -> None:
    """ConfigError unless max_epochs is off, or a finite count of passes over data this run
    has and counts in epochs (SFT and DPO on data.sources). Pure."""
    epochs = config.max_epochs
    if epochs == 0:
        return
    if not (math.isfinite(epochs) and epochs > 0):
        raise ConfigError(f"'max_epochs' = {epochs!r}: must be a finite number > 0 (0: off)")
    refused = mode_of(config).epochs_refused
    if refused:
        raise ConfigError(f"'max_epochs' = {epochs!r}: {refused}: use max_steps")
    if config.data.kind != "sources":
        raise ConfigError(
            f"'max_epochs' = {epochs!r}: data.kind = {config.data.kind!r} is endless; epochs "
            'count passes over data.sources (data.kind = "sources"): use max_steps'
        )


def validate_keep_best(config: Config) -> None:
    """ConfigError unless ckpt.keep_best is off, or names a row key and the checkpoints it
    chooses among have it: more than the final one (ckpt.interval > 0), and for a val/ key,
    saved at steps that are evaluated (a multiple of val.interval). Pure."""
    ckpt, val = config.ckpt, config.val
    if not ckpt.keep_best:
        return
    key, mode = keep_best_rule(ckpt.keep_best)
    where = f"'ckpt.keep_best' = {ckpt.keep_best!r}"
    if not key or ":" in key:
        raise ConfigError(
            f'{where}: expected a row key, "min:KEY" or "max:KEY" (e.g. "val/loss" or '
            '"max:val/reward/mean")'
        )
    if ckpt.interval == 0:
        raise ConfigError(
            f"{where}: ckpt.interval = 0 saves only the final step, so there is no best to "
            "choose: set ckpt.interval"
        )
    if key.startswith("val/") and val.interval == 0:
        raise ConfigError(
            f"{where}: val.interval = 0, so no step's row has {key}: set val.interval (and "
            "make ckpt.interval a multiple of it)"
        )
    if key.startswith("val/") and ckpt.interval % val.interval:
        raise ConfigError(
            f"{where}: only evaluated steps have {key}, but ckpt.interval = {ckpt.interval} is "
            f"not a multiple of val.interval = {val.interval}: make it one"
        )


def validate_lora(config: Config) -> None:
    """ConfigError unless model.lora is off or can build adapters. Pure."""
    lora = config.model.lora

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'model.lora.{key}' = {getattr(lora, key)!r}: {message}")

    require(lora.rank >= 0, "rank", "must be >= 0 (0: no adapters, every parameter trains)")
    if lora.rank == 0:
        require(not lora.modules_to_save, "modules_to_save", "applies with model.lora.rank > 0")
        return
    require(math.isfinite(lora.alpha) and lora.alpha > 0, "alpha", "must be a finite number > 0")
    require(0 <= lora.dropout < 1, "dropout", "must be in [0, 1)")
    require(bool(lora.target_modules), "target_modules", 'name modules, or "all-linear"')
    require(
        "all-linear" not in lora.target_modules or len(lora.target_modules) == 1,
        "target_modules",
        '"all-linear" is a preset: use it alone, or list module names',
    )
    require(
        "lm_head" not in lora.target_modules,
        "target_modules",
        "the loss reads the LM head's weight directly, so an adapter there would not train: "
        'train the head in full with model.lora.modules_to_save = ["lm_head"]',
    )


def validate_sources(sources: tuple[DataSourceConfig, ...], key: str) -> None:
    """ConfigError for a data source that names no data (or two), no columns, a bad weight, or a
    metric name another source of the list has. Pure."""
    for i, source in enumerate(sources):
        at = f"{key}[{i}]"
        if not (source.path or source.dataset):
            raise ConfigError(
                f"'{at}.path' is empty: name a local file or directory, or set '{at}.dataset' "
                "to a Hugging Face dataset name"
            )
        if source.path and source.dataset:
            raise ConfigError(
                f"'{at}': path = {source.path!r} and dataset = {source.dataset!r}: a source "
                "reads one of them; make two sources to read both"
            )
        if source.subset and not source.dataset:
            raise ConfigError(f"'{at}.subset' = {source.subset!r}: only a dataset has subsets")
        if bool(source.prompt_column) != bool(source.completion_column):
            raise ConfigError(
                f"'{at}': prompt_column = {source.prompt_column!r} and completion_column = "
                f"{source.completion_column!r}: name both columns, or neither"
            )
        if not (source.messages_column or source.prompt_column):
            raise ConfigError(
                f"'{at}': messages_column, prompt_column and completion_column are all empty: "
                "name the column of the messages, or the prompt and completion columns"
            )
        if source.weight <= 0:
            raise ConfigError(f"'{at}.weight' = {source.weight}: must be > 0")
    if repeated_source_names(sources):
        names = [source_name(s) for s in sources]
        raise ConfigError(
            f"'{key}': source names must differ (they name metrics), got {names}: set 'name'"
        )


def validate_val(config: Config) -> None:
    """ConfigError unless the val section evaluates something, sometime, that this run can
    evaluate. Pure."""
    val = config.val
    if val.interval < 0:
        raise ConfigError(f"'val.interval' = {val.interval}: must be >= 0 (0: no step)")
    validate_sources(val.sources, "val.sources")
    held_out = held_out_prompts(config) > 0
    if val.samples < 0:
        raise ConfigError(f"'val.samples' = {val.samples}: must be >= 0 (0: greedy episodes only)")
    if val.samples > 0 and not (val.prompts or held_out):
        raise ConfigError(
            f"'val.samples' = {val.samples}: sampled episodes are of held-out prompts, and there "
            "are none: set val.prompts (or the environment's held-out prompts), or val.samples = 0"
        )
    has_data = has_val_data(config)
    evaluates = val.interval > 0 or val.eval_on_start
    if has_data and not evaluates:
        raise ConfigError(
            "'val.interval' = 0 and 'val.eval_on_start' = false: the val data would never be "
            "evaluated; set val.interval (or val.eval_on_start)"
        )
    if evaluates and not has_data:
        raise ConfigError(
            "'val.sources' and 'val.prompts' are empty (and no environment makes held-out "
            "prompts): validation needs data to evaluate "
            f"(val.interval = {val.interval}, val.eval_on_start = {val.eval_on_start})"
        )
    if held_out and config.rollout.environments:
        # A member's keys, val/{name}/*, must not be the start state's val/start/*.
        if "start" in [entry.name for entry in config.rollout.environments]:
            raise ConfigError(
                "'rollout.environments' names an entry 'start', whose held-out prompts would be "
                "validated as val/start/*, the keys of val.eval_on_start: give it another name"
            )
        what = "'rollout.environments' make held-out prompts (val_prompts or their own)"
        undo = "or leave them out"
    elif held_out:
        key = environment_kind(config.rollout.environment).held_out_key
        what, undo = f"'{key}' = {held_out_prompts(config)}", "or the key to 0"
        if val.prompts:
            raise ConfigError(
                f"'val.prompts' = {val.prompts!r}: rollout.environment = "
                f"{config.rollout.environment!r} makes the held-out prompts ({key}); leave "
                "val.prompts empty"
            )
    if held_out and not engine_of(config.rollout).greedy_eval:
        greedy = " or ".join(name for name, engine in ENGINES.items() if engine.greedy_eval)
        raise ConfigError(
            f"{what}: greedy answers to the held-out prompts come from an inference copy of "
            f"the policy, which only the {greedy} rollout engine holds: set rollout.engine to "
            f"it, {undo}"
        )
    if val.prompts:
        if not mode_of(config).rollouts:
            raise ConfigError(
                f"'val.prompts' = {val.prompts!r}: prompts are scored by rollout.reward, so they "
                "need an RL run (fnt rl); an SFT run validates on val.sources"
            )
        if config.rollout.environments:
            raise ConfigError(
                f"'val.prompts' = {val.prompts!r}: rollout.environments is a mixture, and a "
                "prompt of val.prompts names no member to run it; give each entry its own "
                "held-out prompts (rollout.environments[i].val_prompts, or a built-in's own such "
                "as rollout.reasoning_gym.val_size)"
            )
        if not engine_of(config.rollout).greedy_eval or not has_prompts(config.rollout):
            greedy = " or ".join(name for name, engine in ENGINES.items() if engine.greedy_eval)
            raise ConfigError(
                f"'val.prompts' = {val.prompts!r}: greedy answers come from an inference copy of "
                f"the policy, which only the {greedy} rollout engine holds: set rollout.engine "
                "to it, with rollout.prompts"
            )


def _get(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
