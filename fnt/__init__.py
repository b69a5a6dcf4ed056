"""fnt: LLM post-training as an explicit fold over immutable TrainState records.

The public API is importable from here (`from fnt import init_state, fold, run`); each name is
loaded on first use, so that `import fnt.config` (used to reject a bad command line within a
second) stays light. The step functions live in the `steps` package
(`from steps import sft_step, rl_step`); fnt never imports it.
"""

from importlib import import_module

_EXPORTS = {
    # Configuration
    "Config": "fnt.config",
    "RLConfig": "fnt.config",
    "ModelConfig": "fnt.config",
    "DataConfig": "fnt.config",
    "DataSourceConfig": "fnt.config",
    "ValConfig": "fnt.config",
    "load_config": "fnt.config",
    "ConfigError": "fnt.errors",
    "DataError": "fnt.errors",
    # State and the fold
    "Progress": "fnt.state",
    "Handles": "fnt.state",
    "TrainState": "fnt.state",
    "init_state": "fnt.build",
    "restore_": "fnt.build",
    "fold": "fnt.loop",
    "run": "fnt.loop",
    "sft_source": "fnt.sources",
    "rl_source": "fnt.sources",
    "to_floats": "fnt.metrics",
    "Validation": "fnt.validation_pass",
    # The shared helpers of the driver
    "setup_trainer": "fnt.setup",
    "teardown_trainer": "fnt.setup",
    "plan_parallel_dims": "fnt.parallel",
    "resolve_ep": "fnt.parallel",
    "resolve_resume_step": "fnt.resume",
    "start_trace": "fnt.profiler",
    "save_trace": "fnt.profiler",
    "log_step_metrics": "fnt.metrics",
    "setup_optimizer": "fnt.optim",
    "lr_at": "fnt.schedule",
    "save_checkpoint": "fnt.checkpoint",
    "load_checkpoint_": "fnt.checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fnt' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
