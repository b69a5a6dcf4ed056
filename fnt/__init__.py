"""fnt: LLM post-training as an explicit fold over immutable TrainState records.

The shared helpers are importable from here; they are loaded on first use so that
`import fnt.config` (used to reject a bad command line within a second) stays light.
"""

from importlib import import_module

_EXPORTS = {
    "Config": "fnt.config",
    "ConfigError": "fnt.config",
    "load_config": "fnt.config",
    "Progress": "fnt.state",
    "TrainState": "fnt.state",
    "Handles": "fnt.state",
    "fold": "fnt.loop",
    "run": "fnt.loop",
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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fnt' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
