"""The names TRL and transformers users bring, answered with fnt's keys. Pure: a table and a
lookup that the unknown-key message (fnt.config.loading) consults before its did-you-mean."""

from __future__ import annotations

BATCH_NOTE = (
    "fnt counts batch_size as the rows of seq_len tokens per optimizer step over all ranks and "
    "micro_batch_size as the rows of one forward/backward on one rank; accumulation follows "
    "from the two"
)

ALIASES: dict[str, tuple[str | None, str]] = {
    # alias (the last part of the key a user wrote): (fnt's key or None, how fnt differs)
    "learning_rate": ("optim.lr", ""),
    "lr": ("optim.lr", ""),
    "num_train_epochs": ("max_epochs", "resolved to a step count (max_steps) at the start"),
    "epochs": ("max_epochs", "resolved to a step count (max_steps) at the start"),
    "per_device_train_batch_size": ("micro_batch_size", BATCH_NOTE),
    "train_batch_size": ("batch_size", BATCH_NOTE),
    "gradient_accumulation_steps": ("batch_size", BATCH_NOTE),
    "warmup_steps": ("schedule.warmup_steps", ""),
    "warmup_ratio": ("schedule.warmup_steps", "fnt counts warmup in steps"),
    "lr_scheduler_type": ("schedule.kind", ""),
    "max_grad_norm": ("optim.max_norm", ""),
    "weight_decay": ("optim.weight_decay", ""),
    "adam_beta1": ("optim.betas", "fnt takes both betas as one pair"),
    "adam_beta2": ("optim.betas", "fnt takes both betas as one pair"),
    "adam_epsilon": ("optim.eps", ""),
    "optim": ("optim.name", ""),
    "save_steps": ("ckpt.interval", ""),
    "save_total_limit": ("ckpt.keep_last", ""),
    "eval_steps": ("val.interval", ""),
    "max_seq_length": ("seq_len", ""),
    "max_length": ("seq_len", ""),
    "model_name_or_path": ("model.name", ""),
    "resume_from_checkpoint": ("resume", ""),
    "report_to": ("wandb.mode", "W&B is the one remote monitor; metrics.jsonl is always written"),
    "run_name": ("wandb.name", ""),
    "gradient_checkpointing": ("model.ac", ""),
    "dataset_name": ("data.sources", 'a source is {dataset = "org/name"}'),
    "num_generations": ("rollout.group_size", ""),
    "max_completion_length": ("rollout.max_new_tokens", ""),
    "logging_steps": (None, "fnt writes a metrics row and a console line every step"),
}


def alias_hint(key: str, known: list[str]) -> str:
    """`; did you mean 'optim.lr'? (...)` for a key whose last part is a TRL/transformers name
    in ALIASES and whose fnt key this config has; "" otherwise."""
    leaf = key.rsplit(".", 1)[-1].replace("-", "_")
    if leaf not in ALIASES:
        return ""
    target, note = ALIASES[leaf]
    if target is None:
        return f"; {note}"
    if target not in known:
        return ""
    return f"; did you mean '{target}'?" + (f" ({note})" if note else "")
