"""The names TRL and transformers users bring, answered with fnt's keys, and the did-you-mean of
an unknown key. Pure: two tables (`ALIASES`, names with an fnt key; `NO_EQUIVALENT`, names with
none and the sentence each gets) and `suggest`, which the unknown-key message
(fnt.config.loading) ends with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Alias:
    """fnt's key for a name TRL or transformers uses, and how fnt differs."""

    key: str
    note: str = ""
    value: Optional[str] = None  # what `key` takes where the name is a switch (bf16: bfloat16)
    off: Optional[str] = None  # what `key` takes where the switch is off (fnt's default)

    def hint(self, switched_off: bool = False) -> str:
        """`did you mean 'KEY'? (NOTE)`, with the value when the name is a switch: the off value
        (fnt's default, which needs no key) when it was switched off (`--bf16 false`)."""
        if switched_off and self.off is not None:
            return f"did you mean '{self.key}' = \"{self.off}\"? (the default: leave the flag out)"
        value = f' = "{self.value}"' if self.value is not None else ""
        return f"did you mean '{self.key}'{value}?" + (f" ({self.note})" if self.note else "")


BATCH_NOTE = (
    "fnt counts batch_size as the rows of seq_len tokens per optimizer step over all ranks and "
    "micro_batch_size as the rows of one forward/backward on one rank; accumulation follows "
    "from the two"
)
PACKING_NOTE = (
    "fnt always packs samples into rows of seq_len tokens, without padding, and samples in a "
    "row never attend to each other; there is nothing to switch"
)
LORA_NOTE = "LoRA is on when model.lora.rank > 0"
IS_NOTE = (
    "TRL's token_truncate and sequence_truncate are tis, token_mask and sequence_mask are mis, "
    "at loss.is_level token or sequence"
)

# The name a user wrote (the last part of the key): fnt's key, or keys where the name means
# different things to different trainers (the first one the command has is named).
ALIASES: dict[str, Union[Alias, tuple[Alias, ...]]] = {
    "learning_rate": Alias("optim.lr"),
    "lr": Alias("optim.lr"),
    "num_train_epochs": Alias("max_epochs", "resolved to a step count (max_steps) at the start"),
    "epochs": Alias("max_epochs", "resolved to a step count (max_steps) at the start"),
    "per_device_train_batch_size": Alias("micro_batch_size", BATCH_NOTE),
    "train_batch_size": Alias("batch_size", BATCH_NOTE),
    "gradient_accumulation_steps": Alias("batch_size", BATCH_NOTE),
    "warmup_steps": Alias("schedule.warmup_steps"),
    "warmup_ratio": Alias("schedule.warmup_steps", "fnt counts warmup in steps"),
    "lr_scheduler_type": Alias("schedule.kind"),
    "max_grad_norm": Alias("optim.max_norm"),
    "weight_decay": Alias("optim.weight_decay"),
    "adam_beta1": Alias("optim.betas", "fnt takes both betas as one pair"),
    "adam_beta2": Alias("optim.betas", "fnt takes both betas as one pair"),
    "adam_epsilon": Alias("optim.eps"),
    "optim": Alias("optim.name"),
    "data_seed": Alias("seed", "one seed sets the data order and the sampling"),
    "bf16": Alias(
        "model.compute_dtype",
        "bfloat16 compute with float32 parameters and masters; model.dtype sets the parameters'",
        value="bfloat16",
        off="float32",
    ),
    "torch_dtype": Alias("model.dtype"),
    "tf32": Alias("runtime.matmul_precision", "TF32 matmuls", value="high", off="highest"),
    "torch_compile": Alias("model.compile"),
    "gradient_checkpointing": Alias("model.ac"),
    "save_steps": Alias("ckpt.interval"),
    "save_strategy": Alias("ckpt.interval", "fnt saves every ckpt.interval steps"),
    "save_total_limit": Alias("ckpt.keep_last"),
    "metric_for_best_model": Alias(
        "ckpt.keep_best", 'the checkpoint with the lowest value of a row key, "max:KEY" the highest'
    ),
    "load_best_model_at_end": Alias(
        "ckpt.keep_best", "fnt keeps the best checkpoint beside the newest; export the one you want"
    ),
    "eval_steps": Alias("val.interval"),
    "eval_strategy": Alias("val.interval", "fnt evaluates every val.interval steps"),
    "evaluation_strategy": Alias("val.interval", "fnt evaluates every val.interval steps"),
    "eval_on_start": Alias("val.eval_on_start"),
    "ddp_timeout": Alias("runtime.dist_timeout_s"),
    "max_seq_length": Alias("seq_len"),
    "max_length": Alias("seq_len"),
    "model_name_or_path": Alias("model.name"),
    "resume_from_checkpoint": Alias("resume"),
    "report_to": Alias(
        "wandb.mode", "W&B is the one remote monitor; metrics.jsonl is always written"
    ),
    "run_name": Alias("wandb.name"),
    "dataset_name": Alias("data.sources", 'a source is {dataset = "org/name"}'),
    "dataset_config": Alias("data.sources", 'a source\'s subset = "name"'),
    "dataset_train_split": Alias("data.sources", 'a source\'s split = "train"'),
    "chat_template_path": Alias("data.chat_template", "a file path or the template text"),
    "assistant_only_loss": Alias(
        "data.loss_mask", 'the roles trained; ["assistant"] is the default'
    ),
    "completion_only_loss": Alias(
        "data.loss_mask", "a prompt/completion sample trains its completion only, always"
    ),
    # TRL's ModelConfig (PEFT)
    "use_peft": Alias("model.lora.rank", LORA_NOTE),
    "lora_r": Alias("model.lora.rank", LORA_NOTE),
    "lora_alpha": Alias("model.lora.alpha"),
    "lora_dropout": Alias("model.lora.dropout"),
    "lora_target_modules": Alias("model.lora.target_modules"),
    "lora_modules_to_save": Alias("model.lora.modules_to_save"),
    # DPOConfig and GRPOConfig share some names
    "beta": (
        Alias("dpo.beta"),
        Alias("loss.ref_kl_tau", "the weight of the KL to the reference model loss.ref_model"),
    ),
    "loss_type": (
        Alias("dpo.loss"),
        Alias("loss.aggregation", "GRPO's grpo: sequence, dapo: token, dr_grpo: constant"),
    ),
    "label_smoothing": Alias("dpo.label_smoothing"),
    "simpo_gamma": Alias("dpo.simpo_gamma"),
    "ref_model": (Alias("dpo.ref_model"), Alias("loss.ref_model")),
    "precompute_ref_log_probs": Alias("dpo.precompute_reference"),
    "num_generations": Alias("rollout.group_size"),
    "max_completion_length": Alias("rollout.max_new_tokens"),
    "temperature": Alias("rollout.temperature"),
    "top_p": Alias(
        "rollout.vllm.top_p", "the vllm engine's; in_process samples the full vocabulary"
    ),
    "epsilon": Alias("loss.eps_low", 'loss.kind = "ratio" masks by the importance ratio'),
    "epsilon_high": Alias("loss.eps_high", 'loss.kind = "ratio" masks by the importance ratio'),
    "scale_rewards": Alias("rollout.std_normalize"),
    "reward_funcs": Alias("rollout.reward", 'a registry name or "module:function"'),
    "mask_truncated_completions": Alias(
        "rollout.on_truncated", '"drop" leaves them out, "zero" scores them 0'
    ),
    "log_completions": Alias("rollout.log_samples_every"),
    "use_vllm": Alias(
        "rollout.engine", "fnt vllm-serve starts the servers", value="vllm", off="in_process"
    ),
    "vllm_server_host": Alias("rollout.vllm.urls"),
    "vllm_gpu_memory_utilization": Alias("rollout.vllm.gpu_memory_utilization"),
    "vllm_importance_sampling_correction": Alias("loss.is_correction", IS_NOTE),
    "vllm_importance_sampling_mode": Alias("loss.is_correction", IS_NOTE),
    "vllm_importance_sampling_clip_max": Alias(
        "loss.is_cap", "tis's cap; mis's upper bound is in loss.is_bounds = [low, high]"
    ),
    "vllm_importance_sampling_clip_min": Alias("loss.is_bounds", "mis: [low, high]"),
    "rollout_is": Alias(
        "loss.is_level", 'verl\'s truncated weights are loss.is_correction = "tis"'
    ),
    "rollout_is_threshold": Alias("loss.is_cap"),
}

# Names TRL and transformers have and fnt does not: the sentence each is answered with, naming
# fnt's nearest key where there is one.
NO_EQUIVALENT: dict[str, str] = {
    "logging_steps": "fnt writes a metrics row and a console line every step",
    "logging_dir": "fnt writes the metrics to {output_dir}/metrics.jsonl",
    "packing": PACKING_NOTE,
    "padding_free": PACKING_NOTE,
    "dataset_text_field": (
        "fnt reads a column named text as plain text, every token trained, and the other "
        "forms' columns by the names set per source in data.sources (messages_column, "
        "prompt_column, completion_column)"
    ),
    "max_prompt_length": (
        "fnt does not cut prompts alone: data.overlong says what happens to a sample over "
        "seq_len (rollout prompts: a prompt must leave room for max_new_tokens)"
    ),
    "fp16": 'fnt computes in float32 or bfloat16: model.compute_dtype = "bfloat16"',
    "overwrite_output_dir": (
        "fnt never writes over a directory it did not write: choose a new output_dir, or "
        "--resume latest to continue a run"
    ),
    "push_to_hub": "fnt export writes a Hugging Face model directory; upload it from there",
    "hub_model_id": "fnt export writes a Hugging Face model directory; upload it from there",
    "deepspeed": (
        "fnt shards with FSDP2 (parallel.dp_shard) and offloads with optim.offload; torchrun "
        "launches it"
    ),
    "fsdp": "fnt always shards with FSDP2 under torchrun: parallel.dp_shard, parallel.dp_replicate",
    "load_in_4bit": "fnt trains float32 or bfloat16 weights; it loads no quantized model",
    "load_in_8bit": "fnt trains float32 or bfloat16 weights; it loads no quantized model",
    "use_liger_kernel": (
        "fnt computes the loss in chunks of the LM head's logits: model.loss_chunk_tokens, "
        "model.loss_kernel"
    ),
    "neftune_noise_alpha": "fnt adds no noise to the embeddings",
    "per_device_eval_batch_size": "fnt evaluates in micro-batches of micro_batch_size rows",
}


def aliases_of(name: str) -> tuple[Alias, ...]:
    """The Aliases of a TRL/transformers name (none when it is not one)."""
    entry = ALIASES.get(name, ())
    return entry if isinstance(entry, tuple) else (entry,)


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _section(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions counted as one edit ("esp" -> "eps").
    Pure."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[-1]


def _limit(text: str) -> int:
    # One edit in three letters, at least one: "lrr" -> "lr", "learnng_rate" -> "learning_rate".
    return max(1, len(text) // 3)


def _is_off(value: object) -> bool:
    """Whether a switch's value turns it off: `--bf16 false`, `bf16 = false` in a file, 0."""
    return isinstance(value, (bool, int, str)) and str(value).strip().lower() in (
        "false",
        "0",
        "no",
        "off",
    )


def suggest(key: str, known: list[str], value: object = None) -> str:
    """What the unknown-key message says after the key (`; did you mean 'optim.lr'?`), or "".

    The TRL/transformers tables come first: a name in ALIASES gets fnt's key (the first of its
    keys that `known` has), one in NO_EQUIVALENT its sentence; a switch written off (`value`
    false, or the name with `no_` before it, `--no_bf16`) gets the key's off value. Otherwise
    the candidates are the known keys and the aliases' names (as their keys), ranked by the edit
    distance of the last part, plus a section that differs: a typo of the section costs its
    edits, another section one; a key typed without a section matches any. A candidate more than
    a third of the last part's letters away (or a section more than a third away) is no
    suggestion.
    """
    leaf, section = _leaf(key).replace("-", "_"), _section(key)
    switched_off = _is_off(value)
    if leaf.startswith("no_") and aliases_of(leaf[3:]):
        leaf, switched_off = leaf[3:], True
    for alias in aliases_of(leaf):
        if alias.key in known:
            return "; " + alias.hint(switched_off)
    if leaf in NO_EQUIVALENT:
        return f"; {NO_EQUIVALENT[leaf]}"
    candidates = [(_leaf(k), _section(k), k, 0) for k in known]
    candidates += [
        (name, _section(alias.key), alias.key, 1)
        for name in ALIASES
        for alias in aliases_of(name)
        if alias.key in known
    ]
    ranked = []
    for cand_leaf, cand_section, target, is_alias in candidates:
        other_section = int(cand_section != section)
        whole = edit_distance(key, target)  # a section and name run together: "modelname"
        if not is_alias and whole <= _limit(leaf):
            ranked.append((whole, is_alias, other_section, target))
        distance = edit_distance(leaf, cand_leaf)
        if distance > _limit(leaf):
            continue
        if not other_section or not section:
            section_cost = 0
        else:
            section_cost = edit_distance(section, cand_section)
            if section_cost > _limit(section):  # the right name under another section
                section_cost = _limit(section) + 1
        ranked.append((distance + section_cost, is_alias, other_section, target))
    return f"; did you mean '{min(ranked)[-1]}'?" if ranked else ""
