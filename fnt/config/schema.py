"""Config schema: the frozen dataclasses, their introspection and JSON serialization. Pure,
except that `source_kind` (and through it `source_name` and `repeated_source_names`) asks the
filesystem whether a data source's path is a directory, and `field_docs` (through it `all_keys`,
`help_text` and `markdown_keys`) reads this module's source file.

Each field has a one-line docstring right under it; `field_docs` reads them from this module's
source for `--help-config` and the README.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Union, get_args

from dataclasses_json import dataclass_json

from fnt.config.engines import ENGINES
from fnt.config.losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    IS_LEVELS,
    PREFERENCE_LOSSES,
    RL_LOSSES,
)

DtypeName = Literal["float32", "bfloat16"]
"""The dtypes a model's parameters or compute can have (fnt.model.loading.DTYPES maps them to
torch's)."""
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)


@dataclass_json
@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (PEFT): the base model frozen, low-rank updates of its layers trained."""

    rank: int = 0
    """Rank of every adapter; 0 trains every parameter of the model (no adapters)."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B @ A to its layer's weight."""
    dropout: float = 0.0
    """Dropout on each adapter's input (seeded per step, so resume stays exact)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names (or suffixes) that get adapters; "all-linear": every linear but the head."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full and saved with the adapters, e.g. lm_head after adding tokens."""


@dataclass_json
@dataclass(frozen=True)
class ModelConfig:
    """The model to train: where it is, its dtype and attention kernel."""

    name: str = ""
    """Local directory of a Hugging Face causal LM, or a Hub id (org/name) from the HF cache."""
    revision: str = ""
    """The Hub revision (branch, tag or commit) when model.name is a Hub id; "": main."""
    dtype: DtypeName = "float32"
    """Dtype of the model's parameters (and of compute, unless compute_dtype is lower)."""
    compute_dtype: DtypeName = "float32"
    """Dtype of compute; bfloat16 with float32 parameters keeps float32 masters and checkpoints."""
    ac: bool = False
    """Activation checkpointing of every decoder layer (recompute activations in backward)."""
    compile: Union[bool, Literal["auto"]] = "auto"
    """Compile each decoder layer with torch.compile (regional); "auto": on CUDA unless model.ac."""
    attn_implementation: Literal[
        "auto", "varlen", "flex", "sdpa", "eager", "flash_attention_2", "flash_attention_3"
    ] = "auto"
    """Attention kernel ("auto": the fastest here); varlen kernels get document boundaries."""
    loss_chunk_tokens: int = 1024
    """Loss tokens per chunk of the LM head's logits in the loss; 0 computes all logits at once."""
    loss_kernel: Literal["auto", "eager", "compiled"] = "auto"
    """How each loss chunk is computed: eager ops or one torch.compile graph ("auto": by device)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters; off (every parameter trains) unless lora.rank > 0."""


@dataclass_json
@dataclass(frozen=True)
class OptimConfig:
    """The optimizer: algorithm, hyperparameters, implementation and offload."""

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer algorithm."""
    lr: float = 1e-3
    """Peak learning rate (the schedule scales it per step)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1, beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    momentum: float = 0.0
    """SGD momentum."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 measures the norm without clipping."""
    impl: Literal["torch", "native", "reference"] = "torch"
    """AdamW implementation: torch's, fnt's native CPU kernel, or its pure-torch reference."""
    offload: Literal["none", "state", "full"] = "none"
    """Optimizer state with the parameters, on CPU ("state"), or full offload with CPU masters."""
    keep_fp32: tuple[str, ...] = ()
    """Parameter name substrings kept in float32 on the accelerator under full offload."""
    offload_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the compute parameters under full offload (the CPU masters stay float32)."""


@dataclass_json
@dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule (a pure function of the step, see lr_at)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the learning rate after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr: float = 0.0
    """Learning rate reached at the last step by linear and cosine decay."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The message roles data.loss_mask can name."""


@dataclass_json
@dataclass(frozen=True)
class DataSourceConfig:
    """One source of SFT samples (a local file or directory, or a Hugging Face dataset) and its
    share of the mixture."""

    path: str = ""
    """Local JSONL, .parquet or .arrow file, a directory of .parquet/.arrow files, or a glob."""
    dataset: str = ""
    """Instead of path: a Hugging Face dataset name, read with `datasets` (local cache first)."""
    subset: str = ""
    """The dataset's subset (configuration) name; empty for its default one."""
    split: str = "train"
    """The dataset's split."""
    messages_column: str = "messages"
    """Column (JSONL key) of the chat messages; empty if the source has none."""
    prompt_column: str = "prompt"
    """Column (JSONL key) of the prompt of prompt/completion samples; empty if none."""
    completion_column: str = "completion"
    """Column (JSONL key) of the completion of prompt/completion samples; empty if none."""
    chosen_column: str = "chosen"
    """fnt dpo: column (JSONL key) of a pair's preferred response."""
    rejected_column: str = "rejected"
    """fnt dpo: column (JSONL key) of a pair's dispreferred response."""
    weight: float = 1.0
    """Relative share of this source in the mixture."""
    name: str = ""
    """Name used in metrics; empty means the file's stem or the dataset's name."""


@dataclass_json
@dataclass(frozen=True)
class DataConfig:
    """The SFT training data: synthetic, or sources (files, datasets) mixed by weight."""

    kind: Literal["synthetic", "sources"] = "synthetic"
    """synthetic: counting sequences (debugging); sources: data.sources ("jsonl", the old name)."""
    sources: tuple[DataSourceConfig, ...] = ()
    """Sources with weights, e.g. [{path = "train.jsonl", weight = 1.0}, {dataset = "org/name"}]."""
    overlong: Literal["auto", "truncate", "drop", "error"] = "auto"
    """Samples over seq_len: auto drops chats and truncates prompt/completion; or one for all."""
    on_bad_sample: Literal["auto", "error", "skip"] = "auto"
    """auto errors on a bad chat (unknown role, bad content), skips one without a trained turn."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (a pure function of seed and epoch)."""
    loss_mask: tuple[str, ...] = ("assistant",)
    """Roles whose messages are trained: any of system, user, assistant, tool."""
    train_turns: Literal["all", "last"] = "all"
    """Train every assistant turn of a chat, or only its final one."""
    train_reasoning: bool = True
    """Train an assistant turn's reasoning (reasoning_content or a leading <think> block)."""
    chat_template: str = ""
    """Chat template replacing the model's: a file path or the template text (empty: keep it)."""
    cache_dir: str = ""
    """Where tokenized sources are kept for later runs (empty: {output_dir}/data_cache)."""


@dataclass_json
@dataclass(frozen=True)
class ValConfig:
    """Held-out evaluation during training: the loss on held-out samples; in RL, the reward of
    greedy answers."""

    sources: tuple[DataSourceConfig, ...] = ()
    """Held-out samples (same kinds as data.sources, weights unused) for val/loss."""
    prompts: str = ""
    """RL: JSONL prompts run greedily to the episode's end, scored as in training (val/reward)."""
    interval: int = 0
    """Evaluate after every step whose number is a multiple of this; 0 evaluates no step."""
    eval_on_start: bool = False
    """Also evaluate the start state before the first step; the run's first row gets val/start/*."""
    samples: int = 0
    """RL: k sampled episodes per held-out prompt for val/reward/avg@k and pass@k; 0: none."""


@dataclass_json
@dataclass(frozen=True)
class CkptConfig:
    """When checkpoints are saved and how many are kept."""

    interval: int = 0
    """Save a checkpoint every this many steps; 0 saves only the final step."""
    keep_last: int = 0
    """Keep only this many newest checkpoints; 0 keeps all."""
    keep_best: str = ""
    """Also keep the checkpoint with the lowest value of this row key ("max:KEY": the highest)."""
    save_final: bool = True
    """Save the state after the last step."""
    verify: bool = True
    """Check a checkpoint's files against their checksums before resuming (latest falls back)."""


@dataclass_json
@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the parallel dimensions (data parallelism with FSDP2 today)."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dimension)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2); -1 takes whatever the world size leaves."""
    cp: int = 1
    """Context parallel degree (only 1 is implemented)."""
    tp: int = 1
    """Tensor parallel degree (only 1 is implemented)."""
    ep: int | Literal["auto"] = 1
    """Expert parallel degree, or "auto" (only 1 is implemented, so auto resolves to 1)."""


@dataclass_json
@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases logging mode; offline needs no account or network."""
    project: str = "fnt"
    """W&B project name."""
    name: str = ""
    """W&B run name; empty lets W&B choose."""
    timeout_s: float = 60.0
    """A W&B init or log still running after this many seconds disables W&B (also rows at exit)."""
    finish_timeout_s: float = 10.0
    """At the end of a run, W&B's finish gets this many seconds, then is left behind."""


@dataclass_json
@dataclass(frozen=True)
class RuntimeConfig:
    """Process-level settings: threads, matmul precision, timeouts, peak FLOP/s."""

    num_threads: int = 0
    """CPU threads per rank; 0 takes a fair share of the process's CPU affinity per local rank."""
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    """torch.set_float32_matmul_precision."""
    dist_timeout_s: float = 600.0
    """Timeout of collective operations, in seconds."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for perf/mfu; 0 looks it up (CUDA) or assumes 1.0 (CPU)."""
    preempt_exit_code: int = 143
    """Exit status after SIGTERM or SIGUSR1: the step is checkpointed and the run stops there."""
    preempt_grace_s: float = 30.0
    """Seconds a step may take to end after SIGTERM/SIGUSR1; then, or on a 2nd signal, it exits."""


@dataclass_json
@dataclass(frozen=True)
class Config:
    """Everything an SFT run needs, resolved from defaults, a TOML file and the command line."""

    output_dir: str = "runs/default"
    """Run directory: config.json, metrics.jsonl, checkpoints/."""
    seed: int = 0
    """Seed of the data order, synthetic data and sampling."""
    max_steps: int = 10
    """Optimizer steps to run; rows 1..max_steps are written."""
    max_epochs: float = 0.0
    """SFT, DPO: passes over the data to run instead of max_steps (resolved to steps); 0: off."""
    batch_size: int = 8
    """Rows of seq_len tokens per step, all ranks (RL: its episodes take the rows they need)."""
    micro_batch_size: int = 4
    """Rows per forward/backward pass on one rank."""
    seq_len: int = 128
    """Tokens per row (documents are packed into rows)."""
    resume: int | bool | Literal["latest"] | None = None
    """None: start fresh; "latest": newest complete checkpoint if any; N: checkpoint step_N."""
    resume_force: bool = False
    """--resume.force: resume even if seed, data, batch size, seq_len or model changed."""
    trace_path: str | None = None
    """Write a torch profiler trace per rank to trace_path/trace_{rank}.json.gz."""
    trace_steps: int = 0
    """Steps to profile from the first step; 0 profiles every step."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    val: ValConfig = field(default_factory=ValConfig)
    """Held-out evaluation during training."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpointing."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel dimensions."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    monitors: tuple[str, ...] = ()
    """Monitors of your own, "module:Class", each built on rank 0 as Class(config, start_step)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Process-level settings."""


# ---------------------------------------------------------------------------------------------
# RL: the sections `fnt rl` adds

RLLossKind = Literal[tuple(RL_LOSSES)]
"""The names of the RL loss kinds (fnt.config.losses.RL_LOSSES)."""
AggregationName = Literal[tuple(AGGREGATIONS)]
"""The names of the loss aggregations (fnt.config.losses.AGGREGATIONS)."""
ISCorrectionName = Literal[tuple(IS_CORRECTIONS)]
"""The names of the importance-sampling corrections (fnt.config.losses.IS_CORRECTIONS)."""
ISLevelName = Literal[tuple(IS_LEVELS)]
"""The levels an importance-sampling correction weighs at (fnt.config.losses.IS_LEVELS)."""


@dataclass_json
@dataclass(frozen=True)
class RLLossConfig:
    """The RL policy-gradient loss: its kind, aggregation, penalties and reference model."""

    kind: RLLossKind = "dppo_tv"
    """Per-token loss: dppo_tv (prime-rl default), ipo, ratio, gspo, custom (steps/rl_losses.py)."""
    aggregation: AggregationName = "token"
    """Loss sum / loss tokens (token), mean of samples' means (sequence), / samples x max tokens."""
    dppo_mask_low: float = 0.2
    """dppo_tv: mask tokens with A < 0 whose probability already fell by more than this."""
    dppo_mask_high: float = 0.2
    """dppo_tv: mask tokens with A > 0 whose probability already rose by more than this."""
    ipo_threshold: float = 0.1
    """ipo: mask tokens whose probability already moved by more than this, either way."""
    eps_low: float = 0.2
    """ratio: mask tokens with A < 0 whose importance ratio is already below 1 - eps_low."""
    eps_high: float = 0.28
    """ratio: mask tokens with A > 0 whose importance ratio is already above 1 + eps_high."""
    gspo_eps_low: float = 3e-4
    """gspo: mask samples with A < 0 whose sequence ratio is already below 1 - gspo_eps_low."""
    gspo_eps_high: float = 4e-4
    """gspo: mask samples with A > 0 whose sequence ratio is already above 1 + gspo_eps_high."""
    kl_tau: float = 1e-3
    """Weight of the penalty kl_tau * (log r)^2 on every loss token; 0 turns it off."""
    custom: str = ""
    """kind = "custom": "module:function" computing per-token losses fn(inputs, config)."""
    ref_kl_tau: float = 0.0
    """Weight of the KL to a frozen reference policy; 0 builds no reference model."""
    ref_source: Literal["model", "rollouts"] = "model"
    """Reference logprobs from the model ref_model (model), or external samples' ref_logprobs."""
    ref_model: str = ""
    """Directory or Hub id of the reference policy (ref_source = "model"); "": model.name."""
    is_correction: ISCorrectionName = "none"
    """Sampler/trainer importance weight: none, tis (truncated), mis (masked; token: IcePop)."""
    is_level: ISLevelName = "token"
    """is_correction's ratio: per token, or per sample (the product of its token ratios)."""
    is_cap: float = 2.0
    """tis: the weight is min(ratio, is_cap) (Yao et al. 2025 use 2)."""
    is_bounds: tuple[float, float] = (0.5, 5.0)
    """mis: ratios outside [low, high] get weight 0 (IcePop's 0.5 and 5)."""


@dataclass_json
@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM engine's servers: fnt sends them the prompts and the new weights over HTTP."""

    urls: tuple[str, ...] = ("http://127.0.0.1:8000",)
    """Base URLs of the vLLM OpenAI-compatible servers; a step's prompts are spread over them."""
    model: str = ""
    """Model name in requests (vllm serve --served-model-name); empty: the one the server lists."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest token set of this much probability (1: off)."""
    startup_timeout_s: float = 600.0
    """How long to wait for every server's /health at the start of a run."""
    retry_s: float = 60.0
    """How long to retry a failed or refused request (with backoff) before the run stops."""
    gpu_memory_utilization: float = 0.9
    """fnt vllm-serve: the memory fraction vLLM takes (on CPU, of the RAM; --kv-cache-gb wins)."""
    kv_cache_gb: float = 0.0
    """fnt vllm-serve: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU); 0: vLLM's choice."""
    weight_transfer: Literal["disk", "nccl"] = "disk"
    """disk: servers reload weights/step_N/; nccl (GPU, vllm importable here): sent over NCCL."""
    nccl_address: str = "127.0.0.1"
    """weight_transfer = nccl: this trainer's address as the servers reach it (rank 0's host)."""
    nccl_port: int = 29600
    """weight_transfer = nccl: rank 0 listens for server i's NCCL group on nccl_port + i."""


@dataclass_json
@dataclass(frozen=True)
class TaskConfig:
    """One reasoning-gym task of the prompt mixture and its share."""

    name: str = ""
    """The task's reasoning-gym name, e.g. "spell_backward" (fnt rl --list-environments)."""
    weight: float = 1.0
    """Relative share of this task's prompts in the mixture."""
    params: tuple[str, ...] = ()
    """The task's own settings as "key=value" (value read as JSON, else text): "max_word_len=6"."""


@dataclass_json
@dataclass(frozen=True)
class ReasoningGymConfig:
    """rollout.environment = "reasoning_gym[:TASK]": the tasks, their seeds, the answer format."""

    tasks: tuple[TaskConfig, ...] = ()
    """Tasks mixed by weight, with environment = "reasoning_gym" ("reasoning_gym:TASK": one)."""
    seed: int = 0
    """Each task's training prompts use dataset seeds seed .. seed + size - 1."""
    size: int = 10000
    """Training prompts generated per task."""
    val_size: int = 0
    """Held-out prompts per task for val/ (seeds from seed + size on, no training question)."""
    answer: Literal["tag", "text"] = "tag"
    """The answer scored: the reply's last <answer>...</answer> (tag) or the whole reply (text)."""
    system_prompt: str = ""
    """System message of every prompt; empty: reasoning-gym's <answer> instruction (tag), none."""


@dataclass_json
@dataclass(frozen=True)
class MixtureEntryConfig:
    """One environment of a mixture (rollout.environments) and its share of each step's prompts."""

    name: str = ""
    """How metrics (rollout/{name}/reward) and saved samples name it: letters, digits, _ . -."""
    environment: str = ""
    """As rollout.environment: "module:factory", "reasoning_gym:TASK", "verifiers:TASKSET"."""
    environment_args: str = ""
    """As rollout.environment_args, for this environment only."""
    prompts: str = ""
    """JSONL prompts of a "module:factory" (empty: the environment makes its own)."""
    weight: float = 1.0
    """Relative share of this environment's prompts in a step (> 0)."""
    val_prompts: str = ""
    """JSONL held-out prompts of a "module:factory", validated as val/{name}/* (empty: its own)."""


@dataclass_json
@dataclass(frozen=True)
class IsolationConfig:
    """The environment out of the trainer's process: in worker processes, or behind HTTP."""

    workers: int = 0
    """Run each environment in this many worker processes (0: in the trainer's process)."""
    timeout_s: float = 60.0
    """Workers or a served environment: a call unanswered this long fails only its episode."""
    memory_mb: int = 0
    """Workers: the memory (MiB) each may add to what it holds at start; past it, the call fails."""
    failure_reward: float = 0.0
    """Workers or a served environment: the reward of an episode whose call failed."""


EngineName = Literal[tuple(ENGINES)]
"""The names of the rollout engines (fnt.config.engines.ENGINES)."""
ToolParserName = Literal[
    "auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "glm45", "none"
]
"""The tool-call formats (fnt.rollout.environments.parsers.TOOL_PARSERS), and auto."""


@dataclass_json
@dataclass(frozen=True)
class RolloutConfig:
    """Where RL rollouts come from and how they are sampled and scored."""

    engine: EngineName = "in_process"
    """in_process: generate here; external: read {output_dir}/rollouts/; vllm: vLLM servers."""
    prompts: str = ""
    """JSONL file of prompts: {"prompt": ...} or {"messages": [...]}, plus fields for the reward."""
    prompts_per_step: int = 4
    """Prompts sampled per optimizer step, over all data-parallel ranks."""
    group_size: int = 4
    """Completions generated per prompt (advantages are relative within the group)."""
    max_new_tokens: int = 32
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    reward: str = ""
    """Reward function: a registry name (see fnt.rollout.rewards) or "module:function"."""
    environment: str = ""
    """Episodes: "module:factory", "reasoning_gym:TASK", "verifiers:TASKSET"; "": one turn."""
    environment_args: str = ""
    """A JSON object of settings for environment = "verifiers:TASKSET": the taskset config's."""
    environments: tuple[MixtureEntryConfig, ...] = ()
    """Several environments mixed by weight: [[rollout.environments]] (docs/environments.md)."""
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    """Run the environment in worker processes with limits (docs/environments.md)."""
    max_turns: int = 4
    """Model turns per episode at most; an episode out of turns is not truncated: it is scored."""
    max_episode_tokens: int = 0
    """Tokens per episode at most, prompt, replies and sampled turns together (0: seq_len)."""
    lockstep: bool = False
    """true: every turn waits for all episodes (one batched call); false: each goes on alone."""
    env_concurrency: int = 8
    """Environment calls (respond, score) running at once, on threads; 1: one after another."""
    on_truncated: Literal["score", "zero", "drop"] = "score"
    """An episode a length limit cut: scored as it is, given reward 0, or dropped from the batch."""
    tool_parser: ToolParserName = "auto"
    """Tool-call format of model turns (auto: the chat template's family; docs/environments.md)."""
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    """Reasoning split off a turn before tool calls: <think> blocks, none, auto (the template's)."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (plus eps)."""
    credit: Literal["episode", "turn"] = "episode"
    """episode: one advantage per episode; turn: each turn's return-to-go (score_turns; rl.md)."""
    turn_discount: float = 1.0
    """credit = "turn": the discount of later turns' rewards in a turn's return, in (0, 1]."""
    timeout_s: float = 600.0
    """External and vLLM engines: how long to wait for a step's rollouts (vLLM: per request)."""
    keep_weights: int = 2
    """External and vLLM engines: published weight directories to keep (vLLM: > async_level)."""
    on_bad_reward: Literal["error", "skip"] = "error"
    """A NaN/inf or raising reward stops the run (error), or its group gets no advantage (skip)."""
    async_level: int = 0
    """k: step n may train on rollouts of the policy after step n-1-k (0: on-policy)."""
    filter_groups: bool = False
    """Replace groups whose advantages are all zero (equal rewards) with new prompts' (DAPO)."""
    filter_max_rounds: int = 4
    """filter_groups: sampling rounds a step takes at most; the last round's groups all train."""
    publish: Literal["auto", "adapter", "merged"] = "auto"
    """LoRA: publish the adapter or merged weights; auto: adapter (external), merged (vllm)."""
    log_samples_every: int = 0
    """Every N steps, save a step's samples and show a few (0: 4 times a run; -1: never)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """engine = "vllm": the servers and their sampling settings."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """environment = "reasoning_gym[:TASK]": the generated tasks (pip install 'fnt[tasks]')."""


@dataclass_json
@dataclass(frozen=True)
class RLConfig(Config):
    """An RL run: the SFT config's sections plus the loss and the rollouts."""

    loss: RLLossConfig = field(default_factory=RLLossConfig)
    """The policy-gradient loss."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout generation and rewards."""


# ---------------------------------------------------------------------------------------------
# Preference optimization: the section `fnt dpo` adds

PreferenceLossName = Literal[tuple(PREFERENCE_LOSSES)]
"""The names of the preference losses (fnt.config.losses.PREFERENCE_LOSSES)."""


@dataclass_json
@dataclass(frozen=True)
class PreferenceConfig:
    """Preference optimization on pairs (prompt, chosen, rejected): the loss and its reference."""

    loss: PreferenceLossName = "sigmoid"
    """sigmoid (DPO), ipo, simpo, orpo (reference-free), custom (steps/dpo_losses.py)."""
    beta: float = 0.1
    """Scale of the log-ratio margin (sigmoid, simpo), 1/(2 beta) IPO's target, ORPO's lambda."""
    label_smoothing: float = 0.0
    """sigmoid, simpo: the assumed chance that a pair's label is flipped (conservative DPO)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma, subtracted from beta times the mean-logp margin."""
    custom: str = ""
    """loss = "custom": "module:function" computing per-pair losses fn(pairs, config)."""
    ref_model: str = ""
    """Directory or Hub id of the frozen reference; "": model.name (with LoRA: its base)."""
    precompute_reference: bool = False
    """Compute the reference logprobs of every pair once, before step 1, into the data cache."""


@dataclass_json
@dataclass(frozen=True)
class DPOConfig(Config):
    """A preference-optimization run: the SFT config's sections plus the preference loss."""

    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)
    """The preference loss and its reference policy."""


# ---------------------------------------------------------------------------------------------
# Introspection


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field of a dataclass (and its bases), from source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


@cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a config class (the annotations are strings)."""
    return typing.get_type_hints(cls)


def all_keys(cls: type, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Every leaf key of a config class as `dotted.key -> (type, docstring)`."""
    out: dict[str, tuple[Any, str]] = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            out.update(all_keys(tp, key + "."))
        else:
            out[key] = (tp, docs.get(f.name, ""))
    return out


def type_name(tp: Any) -> str:
    """A short human name of a field type, as shown in error messages and help."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return "(" + ", ".join(type_name(a) for a in args) + ")"
    if dataclasses.is_dataclass(tp):
        return "table {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


def help_text(cls: type = Config) -> str:
    """One line per key: `key (type, default): docstring`."""
    defaults = flatten(to_plain(cls()))
    lines = []
    for key, (tp, doc) in all_keys(cls).items():
        lines.append(f"--{key} ({type_name(tp)}; default {json.dumps(defaults.get(key))}): {doc}")
    return "\n".join(lines)


def markdown_keys(*classes: type) -> str:
    """A Markdown table of every key of `classes` (type, default, description), each key once,
    in order of the classes (default: RLConfig, then DPOConfig's own), for the README."""
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    seen: set[str] = set()
    for cls in classes or (RLConfig, DPOConfig):
        defaults = flatten(to_plain(cls()))
        for key, (tp, doc) in all_keys(cls).items():
            if key in seen:
                continue
            seen.add(key)
            kind = type_name(tp).replace("|", "\\|")
            lines.append(f"| `{key}` | {kind} | `{json.dumps(defaults.get(key))}` | {doc} |")
    return "\n".join(lines)


BEST_MODES = ("min", "max")
"""The prefixes of ckpt.keep_best: "min:KEY" (the default, as for a loss) or "max:KEY"."""


def keep_best_rule(keep_best: str) -> tuple[str, str]:
    """`(row key, "min" or "max")` of a ckpt.keep_best value: "val/loss" -> ("val/loss", "min"),
    "max:val/reward/mean" -> ("val/reward/mean", "max"). Pure; the key may be empty."""
    mode, colon, key = keep_best.partition(":")
    if colon and mode in BEST_MODES:
        return key, mode
    return keep_best, "min"


# What a data source's path is, by its form (fnt.data.load reads each kind).
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
GLOB_CHARS = "*?["


def source_kind(source: DataSourceConfig) -> str:
    """dataset, glob, directory, parquet, arrow or jsonl: a Hugging Face dataset, a path with
    `*`, `?` or `[`, an existing directory, a file by its suffix, and any other path. Pure apart
    from asking whether the path is a directory."""
    if source.dataset:
        return "dataset"
    if any(char in source.path for char in GLOB_CHARS):
        return "glob"
    if os.path.isdir(source.path):
        return "directory"
    suffix = os.path.splitext(source.path)[1]
    return suffix[1:] if suffix in COLUMNAR_SUFFIXES else "jsonl"


def source_name(source: DataSourceConfig) -> str:
    """A source's metric name: its `name`, else the file's stem (a glob's up to the first
    wildcard) or the dataset's last part."""
    if source.name:
        return source.name
    if source.dataset:
        return source.dataset.rstrip("/").rsplit("/", 1)[-1]
    path = source.path.rstrip("/")
    stem = os.path.splitext(os.path.basename(path))[0]
    if source_kind(source) == "glob":  # the name before its first wildcard
        before = re.split(r"[*?\[]", path)[0]
        stem = os.path.basename(before).strip("-_.") or os.path.basename(before.rstrip("/"))
    return stem or "files"


def repeated_source_names(sources) -> list[str]:
    """The metric names (`source_name`) more than one of `sources` has, sorted: they must
    differ, as they key the progress/{source}/* metrics. Pure."""
    names = [source_name(source) for source in sources]
    return sorted({name for name in names if names.count(name) > 1})


# ---------------------------------------------------------------------------------------------
# Serialization


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_plain(config: Any) -> dict:
    """A JSON-ready nested dict (tuples become lists)."""
    return json.loads(config.to_json())


def to_json(config: Any) -> str:
    return json.dumps(to_plain(config), indent=2, sort_keys=True)
