"""Every command's input checks, made before anything heavy. They cover model, tokenizer, data
and prompts files, the resume step, references to the user's functions, LoRA's target modules,
checkpoints to read and the places outputs go. Side effects: reads those files and directories
(the first record of each data file only), imports the modules a "module:function" reference
names, and `require_lora_targets` builds the model on the meta device (no weights are read).

A mistake in any of them should cost a second and one line, not a minute of imports, process
groups and model building followed by a traceback. The full checks still run where the inputs are
used (every record when the data is tokenized); these catch what is wrong at the first glance.

The rules of paths every command shares are fnt.store.paths' (a file or directory that must
exist, a checkpoint, a writable place, an output directory or file a command may write); those
of "module:function" references fnt.config.references.require_function (rollout.reward:
fnt.rollout.rewards.require_reward). The commands' own checks here combine them:
`check_inputs` (sft, rl, dpo: the data and prompts through the function the config's mode
names, fnt.config.modes: `preflight`), `check_model_and_data` (show-data), `check_export`,
`check_generate`. A new command adds its function here from the same rules.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Callable, Optional

from fnt.config import Config, DataSourceConfig, RLConfig, RolloutConfig, engine_of, mode_of
from fnt.config.environments import (
    environment_kind,
    member_rollout,
    require_installed,
    supplies_prompts,
)
from fnt.config.modes import reference_dir
from fnt.config.references import ENVIRONMENT_SHAPE, import_function, require_function
from fnt.config.schema import source_kind
from fnt.errors import CheckpointError, ConfigError, DataError, UserCodeError, named
from fnt.resume import resolve_resume_step
from fnt.rollout.rewards import require_reward
from fnt.store.jsonl import jsonl_records
from fnt.store.paths import (
    EXPORT,
    PathLike,
    check_output_dir,
    require_checkpoint,
    require_run_output_dir,
)
from fnt.store.rundir import CONFIG_FILE, META_FILE, ckpt_root, run_entries
from fnt.store.source_files import directory_files, glob_files
from fnt.store.transaction import output_marker

# Any one of these is a tokenizer transformers can load without extra packages' guesswork.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
)


def check_inputs(config: Config, model_name_source: str) -> None:
    """Everything checkable before the model is built, for `fnt sft`, `fnt rl` and `fnt dpo`; raises
    ConfigError or DataError. Reads only: nothing is written until every check has passed.

    JSONL sources get their first record checked; parquet/Arrow files their existence,
    directories and glob patterns that they hold or match such a file; Hugging Face datasets
    are resolved by the loader. The LoRA check comes last, as the costliest (it imports
    transformers and PEFT)."""
    require_run_output_dir(config.output_dir)
    require_model(config, model_name_source)
    for key, reference in reference_models(config):
        require_model_dir(reference, key=key)
    check_data(config)
    # Raises ResumeError (a ConfigError) for `--resume N` without a complete step_N.
    resolve_resume_step(config.resume, ckpt_root(config.output_dir))
    require_lora_targets(config)


def reference_models(config: Config) -> list[tuple[str, str]]:
    """(key, directory) of each reference policy the config names (its mode's reference_key:
    RL's loss.ref_model, DPO's dpo.ref_model); empty ones mean model.name, which is checked
    already. Pure."""
    key, path = mode_of(config).reference_key, reference_dir(config)
    return [(key, path)] if path else []


def check_model_and_data(config: Config, model_name_source: str) -> None:
    """What `fnt show-data` reads: `require_model` and `check_data`."""
    require_model(config, model_name_source)
    check_data(config)


def check_rollout_inputs(config: RLConfig, model_name_source: str) -> None:
    """What `fnt show-rollouts` reads: `require_model`, what runs the episodes
    (`require_episodes`), the first record of rollout.prompts and the user's code on it
    (`try_user_code`)."""
    require_model(config, model_name_source)
    require_episodes(config.rollout)
    check_first_prompt(config.rollout)
    try_user_code(config.rollout)


def check_first_prompt(rollout: RolloutConfig) -> None:
    """The first record of rollout.prompts, unless the environment makes the prompts."""
    if supplies_prompts(rollout):
        return
    first = first_record(rollout.prompts, "rollout.prompts")
    from fnt.rollout.prompts import prompt_messages

    check_record(first, prompt_messages)


def try_user_code(rollout: RolloutConfig) -> None:
    """The user's code called once on the first record of rollout.prompts before any model is
    built (`trial_run`): the environment factory, its start and its score,
    or the reward on a trial completion. A UserCodeError names the function, what it raised or
    returned and the record. Not for an integration that makes its own prompts (fnt's code).
    A mixture's members (rollout.environments) are tried each on its own entry's."""
    for entry in rollout.environments:
        try_user_code(member_rollout(rollout, entry))
    kind = environment_kind(rollout.environment)
    if supplies_prompts(rollout) or (kind.build and not kind.runs_user_code):
        return
    path, line_number, record = first_record(rollout.prompts, "rollout.prompts")
    trial_run(rollout, record, f"the prompt of line {line_number} of {path}")


def trial_completion(record: object) -> str:
    """The completion a reward is tried on at start-up: the record's "answer" when it is a
    string (a right answer must score without error), else "x". Pure."""
    answer = record.get("answer") if isinstance(record, dict) else None
    return answer if isinstance(answer, str) and answer else "x"


def trial_run(rollout: RolloutConfig, record: object, where: str) -> None:
    """Call what scores the run's episodes once on `record` (the first prompt record, `where`
    names it): rollout.environment's factory (or the single-turn environment of
    rollout.reward), the environment's `start(record)` and its `score` of the first messages
    followed by a trial completion (`trial_completion`). UserCodeError for a raise or a wrong
    return; a reward's NaN passes (rollout.on_bad_reward decides about it in the run). A pool
    of workers (rollout.isolation) stays open: the run's engine and evaluation use it."""
    from fnt.rollout.environments import environment_of

    environment, name = environment_of(rollout)
    trial_calls(environment, name, record, where)


def trial_calls(environment: object, name: str, record: object, where: str) -> None:
    """`trial_run`'s calls of the built environment."""
    from fnt.rollout.environments import Start
    from fnt.rollout.environments.protocol import weighted_reward
    from fnt.rollout.user_code import call_user, shown

    start = call_user(environment.start, f"{name} failed to start {where}", record)
    if not isinstance(start, Start):
        raise UserCodeError(
            f"{name} (its start) returned {shown(start)} on {where}; expected a "
            "Start(messages, tools=None) (fnt.rollout.environments.protocol)"
        )
    completion = trial_completion(record)
    messages = [*start.messages, {"role": "assistant", "content": completion}]
    what = f"{name} failed on {where} with the trial completion {shown(completion)}, at start-up"
    value = call_user(environment.score, what, record, messages)
    weights = getattr(environment, "reward_weights", None)
    try:
        weighted_reward(value, weights or {}, name, f"{where} (the trial completion, at start-up)")
    except ValueError as e:
        raise UserCodeError(str(e)) from None


def require_model(config: Config, model_name_source: str) -> None:
    """The model directory, and its tokenizer where one is needed."""
    require_model_dir(config.model.name, model_name_source)
    rollouts = mode_of(config).rollouts  # prompts are rendered with the tokenizer
    if rollouts or config.data.kind == "sources":
        require_tokenizer_files(config.model.name, "RL" if rollouts else 'data.kind = "sources"')


def check_data(config: Config) -> None:
    """What the config's mode reads of its data and prompts (fnt.config.modes: `preflight`,
    one of the three below): the first record of each JSONL data source and the existence of
    the other local sources."""
    import_function(mode_of(config).preflight, 1)(config)


def check_sample_data(config: Config) -> None:
    """SFT's preflight: the first record of each JSONL source of data.sources and val.sources
    is a chat sample."""
    check_first_records(config, training_sources(config) + val_sources(config), chat_sample)


def check_rollout_data(config: RLConfig) -> None:
    """RL's preflight: the first record of each JSONL source of val.sources is a chat sample;
    an engine that runs the episodes itself has what runs them (`require_episodes`), the first
    record of rollout.prompts, and the user's reward or environment runs on it
    (`try_user_code`)."""
    check_first_records(config, val_sources(config), chat_sample)
    if engine_of(config.rollout).samples_prompts:
        require_episodes(config.rollout)
        check_first_prompt(config.rollout)
        try_user_code(config.rollout)


def check_pair_data(config: Config) -> None:
    """DPO's preflight: the first record of each JSONL source of data.sources and val.sources
    is a preference pair."""
    check_first_records(config, training_sources(config) + val_sources(config), pair_sample)


def training_sources(config: Config) -> list[tuple[str, DataSourceConfig]]:
    """(key, source) of each source of data.sources, when data.kind = "sources". Pure."""
    if config.data.kind != "sources":
        return []
    return [(f"data.sources[{i}]", s) for i, s in enumerate(config.data.sources)]


def val_sources(config: Config) -> list[tuple[str, DataSourceConfig]]:
    """(key, source) of each source of val.sources. Pure."""
    return [(f"val.sources[{i}]", s) for i, s in enumerate(config.val.sources)]


def chat_sample(record: object, source: DataSourceConfig) -> object:
    """The conversation of an SFT record; ValueError with the reason when it is not one."""
    from fnt.data.chat import conversation_from_record
    from fnt.data.load import chat_record

    return conversation_from_record(chat_record(record, source))


def pair_sample(record: object, source: DataSourceConfig) -> object:
    """The pair of a DPO record; ValueError with the reason when it is not one."""
    from fnt.data.pairs import pair_from_record

    return pair_from_record(record, source)


def check_first_records(
    config: Config, sources: list[tuple[str, DataSourceConfig]], parse: Callable
) -> None:
    """The first record of each JSONL source of `sources` (key, source) parses with
    `parse(record, source)`, the other local files exist, and directories and glob patterns
    name files. Every file is read before `parse` imports the
    module with its record rules (that costs torch)."""
    firsts = []
    for key, source in sources:
        kind, at = source_kind(source), f"{key}.path"
        if kind == "jsonl":
            firsts.append((first_record(source.path, at), source))
        elif kind in ("parquet", "arrow"):
            require_path(source.path, at)
        elif kind == "directory":
            directory_files(source.path, named(at, source.path))
        elif kind == "glob":
            glob_files(source.path, named(at, source.path))
    for first, source in firsts:
        check_record(first, lambda r, s=source: parse(r, s))


def require_episodes(rollout: RolloutConfig) -> None:
    """ConfigError unless what runs the episodes can be found: rollout.environment's factory
    (imported, taking the rollout config), or without one rollout.reward. A user's factory is
    called by `try_user_code`, after the first prompt record is checked; a built-in
    integration's is called here (fnt.config.environments), which checks its extra and
    settings. A mixture's members (rollout.environments) are checked each as its own."""
    if rollout.environments:
        for entry in rollout.environments:
            require_episodes(member_rollout(rollout, entry))
        return
    kind = environment_kind(rollout.environment)
    if kind.build:  # a built-in integration: its extra installed, its settings accepted
        require_installed(kind, rollout.environment)
        import_function(kind.build, 1)(rollout)
    elif rollout.environment:
        require_function(rollout.environment, "rollout.environment", 1, ENVIRONMENT_SHAPE)
    else:
        require_reward(rollout.reward)


def require_lora_targets(config: Config) -> None:
    """ConfigError unless model.lora's target_modules and modules_to_save name modules of the
    model: the adapters are added to the model built on the meta device from its config.json
    (fnt.model.loading.empty_hf_model), the way the sharded load adds them, so no weight is read
    and a misspelled module costs the imports, not the load. Nothing to check without LoRA."""
    if not config.model.lora.rank:
        return
    from fnt.model.loading import empty_hf_model
    from fnt.model.lora import add_adapters_

    add_adapters_(empty_hf_model(config.model), config.model.lora)


def check_export(checkpoint: PathLike, out: PathLike, force: bool) -> None:
    """`fnt export`'s inputs: a complete checkpoint whose base model directory (with tokenizer)
    is still there (`check_export_source`), and an --out that export may write
    (`check_output_dir`). Reads only."""
    check_export_source(checkpoint)
    check_output_dir(out, "--out", EXPORT, force=force, keep=(Path(checkpoint),))


def check_export_source(checkpoint: PathLike) -> None:
    """A complete checkpoint at `checkpoint` whose base model directory, with its tokenizer, is
    still there: what `fnt export` and `fnt generate` read. Reads only."""
    meta = require_checkpoint(checkpoint, "--checkpoint")
    base = meta.get("model_name")
    has_tokenizer = isinstance(base, str) and any(
        os.path.isfile(os.path.join(base, file)) for file in TOKENIZER_FILES
    )
    if not (isinstance(base, str) and os.path.isfile(os.path.join(base, CONFIG_FILE))):
        raise CheckpointError(
            f"{named('--checkpoint', checkpoint)}: its base model {base!r} (meta.json "
            "model_name) is not a Hugging Face model directory (no config.json there); the "
            "export reads the architecture and tokenizer from it: put the base model back there"
        )
    if not has_tokenizer:
        raise CheckpointError(
            f"{named('--checkpoint', checkpoint)}: its base model {base!r} has no tokenizer "
            f"files (one of {', '.join(TOKENIZER_FILES)}), which the export copies"
        )
    from fnt.model.directory import config_problem, tokenizer_problem

    problem = config_problem(base) or tokenizer_problem(base)
    if problem:
        raise CheckpointError(
            f"{named('--checkpoint', checkpoint)}: its base model {base!r} (meta.json "
            f"model_name): {problem}"
        )


def export_marker(checkpoint: PathLike, dtype: Optional[str], merge: bool) -> str:
    """The marker text of an export (fnt.store.transaction.output_marker): what tells an earlier
    export, which `check_export` lets the next one replace, from anyone else's files. Pure."""
    return output_marker(EXPORT, checkpoint=os.path.abspath(checkpoint), dtype=dtype, merge=merge)


def require_model_dir(name: str, source: str = "", key: str = "model.name") -> None:
    """Raise ConfigError unless `name` (the value of `key`, from `source` when known) is a
    Hugging Face model directory that from_pretrained can load: a config.json that parses and
    names a causal LM transformers has, and complete weights (fnt.model.directory).

    Checked up front because from_pretrained, given a missing directory, fails only after the
    heavy imports, with a message about the Hugging Face Hub; and given a truncated config.json
    or a missing shard, with a long traceback.
    """
    from fnt.model.directory import model_dir_problem

    came_from = f" ({source})" if source else ""
    if name and os.path.isfile(os.path.join(name, CONFIG_FILE)):
        problem = model_dir_problem(name)
        if problem is None:
            return
        raise ConfigError(f"{named(key, name)}{came_from}: {problem}")
    target = shlex.quote(name) if name else "DIR"
    raise ConfigError(
        f"{named(key, name)}{came_from}: no Hugging Face model there (expected a directory "
        "with config.json); point it at a local model directory, or for a tiny test model (the "
        f"debug configs use one) create it with: fnt make-tiny-model --out {target}"
    )


def require_tokenizer_files(name: str, needed_by: str, key: str = "model.name") -> None:
    """Raise ConfigError unless the model directory holds tokenizer files whose JSON ones parse
    (`needed_by` says what needs a tokenizer). transformers would otherwise suggest installing
    sentencepiece, or fail deep in the tokenizer library."""
    from fnt.model.directory import tokenizer_problem

    if not any(os.path.isfile(os.path.join(name, file)) for file in TOKENIZER_FILES):
        raise ConfigError(
            f"{named(key, name)}: no tokenizer files in the model directory (expected one of "
            f"{', '.join(TOKENIZER_FILES)}), and {needed_by} needs a tokenizer; copy the "
            "tokenizer files that belong to the model into it"
        )
    problem = tokenizer_problem(name)
    if problem:
        raise ConfigError(f"{named(key, name)}: {problem}, and {needed_by} needs the tokenizer")


def require_path(path: str, key: str) -> None:
    """DataError unless `path` exists (a columnar file, read later)."""
    if not os.path.exists(path):
        raise DataError(f"'{key}' = {path!r}: no such file or directory")


def first_record(path: str, key: str) -> tuple[str, int, object]:
    """(path, line number, parsed JSON) of the first non-blank line of the file at `key`;
    DataError if it cannot be read, is empty, or that line is not JSON."""
    first = next(jsonl_records(path, f"'{key}' = {path!r}"), None)
    if first is None:
        raise DataError(f"'{key}' = {path!r}: the file is empty (no JSONL records)")
    return path, *first


def check_record(first: tuple[str, int, object], parse) -> None:
    """DataError unless `parse` (which raises ValueError with the reason) accepts the record."""
    path, line_number, record = first
    try:
        parse(record)
    except ValueError as e:
        raise DataError(f"{path}, line {line_number}: {e}") from e


def check_generate(checkpoint: PathLike, prompts_file: Optional[str]) -> str:
    """`fnt generate`'s inputs: `checkpoint` is a complete checkpoint whose base model is still
    there (as for `check_export`) or a Hugging Face model directory with a tokenizer, and every
    record of `prompts_file` (when given) is a prompt record. Returns "checkpoint" or "model",
    what `checkpoint` is. Reads only."""
    path = Path(checkpoint)
    if os.path.isdir(path) and not (path / META_FILE).is_file() and not run_entries(path):
        if not (path / CONFIG_FILE).is_file():
            raise CheckpointError(
                f"{named('--checkpoint', path)}: neither a checkpoint (RUN/checkpoints/step_N) "
                "nor a Hugging Face model directory (no config.json there)"
            )
        if not any((path / file).is_file() for file in TOKENIZER_FILES):
            raise CheckpointError(
                f"{named('--checkpoint', path)}: no tokenizer files in the model directory "
                f"(expected one of {', '.join(TOKENIZER_FILES)}), which generating needs"
            )
        require_model_dir(str(path), key="--checkpoint")
        require_tokenizer_files(str(path), "generating", key="--checkpoint")
        kind = "model"
    else:
        check_export_source(path)
        kind = "checkpoint"
    if prompts_file is not None:
        what = named("--prompts", prompts_file)
        # Every line parsed first: a file that is not JSONL is told without importing torch.
        records = list(jsonl_records(prompts_file, what))
        if not records:
            raise DataError(f"{what}: the file is empty (no JSONL prompt records)")
        from fnt.rollout.prompts import prompt_messages

        for line_number, record in records:
            check_record((prompts_file, line_number, record), prompt_messages)
    return kind
