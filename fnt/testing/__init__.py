"""Property-based tests of resume and logging for your own steps: hypothesis strategies and two
ready properties. Needs the `testing` extra (`pip install 'fnt[testing]'`: hypothesis).
Side effects: importing it registers two hypothesis profiles and reads $FNT_TESTING_PROFILE; the
properties run fnt's driver (fnt.testing.properties) and `write_listing_` creates directories
(fnt.testing.strategies).

- strategies (`fnt.testing.strategies`): `tiny_configs` (valid SFT and RL configs of the tiny
  model, 1 or 2 ranks), `checkpoint_listings` and `write_listing_` (checkpoint directories with
  complete, partial and damaged entries), `metrics_files` (metrics.jsonl contents with missing,
  duplicated, torn and garbled rows), `crash_points` (the `FNT_FAULT` phases and steps) and
  `metric_dicts`;
- properties (`fnt.testing.properties`): `assert_resume_exact(config, step_fn, source,
  kill_at=...)` (a run killed at a point and resumed writes the rows and ends with the weights
  of the uninterrupted run) and `assert_one_row_per_step(config, step_fn, source, crashes=...)`
  (under any pattern of kills and resumes, metrics.jsonl holds each step once, and so does the
  W&B run, a stub with a server-side history: `WANDB_STUB`).

`PROPERTY_SETTINGS` are the hypothesis settings for tests that run these properties: the
profile "fnt" (2 examples: each runs fnt a few times), or with FNT_TESTING_PROFILE=fnt-thorough
25 examples.
"""

import os

try:
    import hypothesis  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "fnt.testing needs hypothesis: pip install 'fnt[testing]'", name=e.name
    ) from None

from hypothesis import HealthCheck, settings

from fnt.testing.properties import (
    WANDB_STUB,
    assert_one_row_per_step,
    assert_resume_exact,
    measured_key,
)
from fnt.testing.strategies import (
    checkpoint_listings,
    crash_points,
    metric_dicts,
    metrics_files,
    tiny_configs,
    write_listing_,
)

_RUNS_ARE_SLOW = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("fnt", max_examples=2, **_RUNS_ARE_SLOW)
settings.register_profile("fnt-thorough", max_examples=25, **_RUNS_ARE_SLOW)
PROPERTY_SETTINGS = settings.get_profile(os.environ.get("FNT_TESTING_PROFILE", "fnt"))
"""Settings for a test that runs a property of this module once per example."""

__all__ = [
    "PROPERTY_SETTINGS",
    "WANDB_STUB",
    "assert_one_row_per_step",
    "assert_resume_exact",
    "checkpoint_listings",
    "crash_points",
    "measured_key",
    "metric_dicts",
    "metrics_files",
    "tiny_configs",
    "write_listing_",
]
