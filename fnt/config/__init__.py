"""Configuration: the frozen dataclasses, loading from TOML and the command line, validation.
Side effects: loading reads the TOML file and prints a warning for a deprecated spelling;
validation imports the modules a config names (monitors, loss.custom, dpo.custom); a data
source's kind asks whether its path is a directory; the rest is pure.

- `fnt.config.schema`: the dataclasses, their introspection (help, README table), JSON.
- `fnt.config.loading`: defaults < TOML file < command line, and JSON back into a config.
- `fnt.config.validation`: cross-field rules, the parallel plan included.

Nothing here imports torch or transformers (a module a config names may: validation imports it),
so the scripts reject a bad command line within about a second.
"""

from fnt.config.engines import ENGINES, Engine, engine_of
from fnt.config.loading import CliArgs, from_json, load_config, split_cli
from fnt.config.modes import MODES, Mode, check_filter_groups, mode_of, validate_rollout
from fnt.config.schema import (
    CkptConfig,
    Config,
    DataConfig,
    DataSourceConfig,
    DPOConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PreferenceConfig,
    RLConfig,
    RLLossConfig,
    RolloutConfig,
    RuntimeConfig,
    ScheduleConfig,
    ValConfig,
    VLLMConfig,
    WandbConfig,
    all_keys,
    field_docs,
    field_types,
    flatten,
    help_text,
    markdown_keys,
    source_name,
    to_json,
    to_plain,
    type_name,
)
from fnt.config.validation import validate
from fnt.errors import ConfigError

__all__ = [
    "CkptConfig",
    "CliArgs",
    "Config",
    "ConfigError",
    "DataConfig",
    "DPOConfig",
    "DataSourceConfig",
    "ENGINES",
    "Engine",
    "LoraConfig",
    "MODES",
    "Mode",
    "VLLMConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PreferenceConfig",
    "RLConfig",
    "RLLossConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "ValConfig",
    "WandbConfig",
    "all_keys",
    "engine_of",
    "field_docs",
    "field_types",
    "flatten",
    "from_json",
    "help_text",
    "load_config",
    "markdown_keys",
    "mode_of",
    "source_name",
    "split_cli",
    "to_json",
    "to_plain",
    "type_name",
    "validate",
    "validate_rollout",
    "check_filter_groups",
]
