"""fnt: LLM post-training as an explicit fold over immutable TrainState records. Pure: this
file only re-exports the public API (the side effects of each name are its module's).

The public API is importable from here (`from fnt import init_state, fold, run`); each name is
loaded on first use, so that `import fnt.config` (used to reject a bad command line within a
second) stays light. The step functions live in the `steps` package
(`from steps import sft_step, rl_step, dpo_step`); fnt never imports it.
"""

from importlib import import_module

_EXPORTS = {
    # Configuration
    "Config": "fnt.config",
    "RLConfig": "fnt.config",
    "DPOConfig": "fnt.config",
    "PreferenceConfig": "fnt.config",
    "LoraConfig": "fnt.config",
    "ModelConfig": "fnt.config",
    "DataConfig": "fnt.config",
    "DataSourceConfig": "fnt.config",
    "ValConfig": "fnt.config",
    "load_config": "fnt.config",
    "validate": "fnt.config",
    "ConfigError": "fnt.errors",
    "DataError": "fnt.errors",
    # State and the fold
    "Progress": "fnt.state",
    "Handles": "fnt.state",
    "TrainState": "fnt.state",
    "Component": "fnt.state",
    "init_state": "fnt.build",
    "save_state_": "fnt.build",
    "restore_": "fnt.build",
    "fold": "fnt.loop",
    "run": "fnt.loop",
    "sft_source": "fnt.sources",
    "rl_source": "fnt.sources",
    "pair_source": "fnt.sources",
    "to_floats": "fnt.obs.metrics",
    "Evaluation": "fnt.evaluation",
    # The research kit: what a step function of your own is made of
    "accumulate_gradients_": "fnt.update",
    "complete_step_": "fnt.update",
    "TokenLogprobs": "fnt.model.lm_head",
    "SftBatch": "fnt.batch",
    "RLBatch": "fnt.batch",
    "PackedRows": "fnt.batch",
    "RLMicroBatch": "fnt.batch",
    "PairBatch": "fnt.batch",
    "PairMicroBatch": "fnt.batch",
    "PairLogps": "fnt.preference",
    # The process, the optimizer, the schedule, the profiler
    "setup_trainer": "fnt.distributed.runtime",
    "teardown_trainer": "fnt.distributed.runtime",
    "setup_optimizer": "fnt.optim",
    "lr_at": "fnt.schedule",
    "resolve_resume_step": "fnt.resume",
    "start_trace": "fnt.obs.profiler",
    "save_trace": "fnt.obs.profiler",
    "save_trace_": "fnt.obs.profiler",
    "log_step_metrics": "fnt.rows",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fnt' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
