"""Held-out evaluation: which rows of a run get which val keys (`Evaluation`, here), and the
held-out data each mode evaluates (`held_out`: the samples and prompts of SFT and RL; `pairs`:
the pairs of DPO and its precomputed reference). Side effects: `Evaluation` calls the state's
`val` handle (an fnt.state.Evaluator: forward passes, collectives) and reads the clock.

This file is the driver's side, which the core (fnt.rows) uses, and knows the held-out data by
the Evaluator protocol only; the submodules are plugins, which fnt.config.modes names as each
mode's `eval_data` and only the composition root (fnt.build) imports.

- An evaluation after step N, when N is a multiple of val.interval, goes into row N: val/loss
  (the summed cross entropy of all loss tokens over their count), val/perplexity (its exp) and
  val/num_tokens (that count) with val.sources; val/reward/mean with val.prompts (or an
  environment's held-out prompts), and val/reward/avg@k and val/reward/pass@k with val.samples
  = k; per environment of a mixture, val/{name}/reward/mean (and avg@k, pass@k); the same keys
  at every evaluation, named by the config.
- `val.eval_on_start` evaluates the start state (after S updates: 0, or the resumed
  checkpoint's step) before the first step, and its values go into the run's first row, S + 1,
  as val/start/loss, val/start/perplexity, val/start/num_tokens, val/start/reward/mean. They have
  keys of their own because val/* of a row always describe the model that row ends with: row
  S + 1 has val/* itself when S + 1 is a multiple of val.interval.
- Every row of a run with validation has time/val, the seconds the row's evaluations took (0
  when none ran), so that time/step stays the optimizer step's time.
"""

from __future__ import annotations

import time
from typing import Mapping

from fnt.state import TrainState

PREFIX = "val/"
START_PREFIX = "val/start/"


def is_due(step: int, interval: int) -> bool:
    """Whether the state after `step` updates is evaluated: step is a multiple of interval > 0."""
    return interval > 0 and step > 0 and step % interval == 0


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    return {prefix + key: value for key, value in metrics.items()}


class Evaluation:
    """The val metrics of each row of a run: `row_metrics(state)` is called once per row, with
    the state the row ends with. Built with the start state, which it evaluates right away when
    val.eval_on_start is set (see the module docstring for which keys go into which row)."""

    def __init__(self, state: TrainState) -> None:
        self.interval = state.config.val.interval
        self.enabled = state.handles.val is not None
        self.pending: dict[str, float] = {}
        self.pending_seconds = 0.0
        config = state.config
        if self.enabled and config.val.eval_on_start and state.progress.step < config.max_steps:
            started = time.perf_counter()
            self.pending = prefixed(state.handles.val.evaluate(state), START_PREFIX)
            self.pending_seconds = time.perf_counter() - started

    def row_metrics(self, state: TrainState) -> dict[str, float]:
        """val/* (when this row's step is due), val/start/* (in the first row) and time/val."""
        if not self.enabled:
            return {}
        row, seconds = self.pending, self.pending_seconds
        self.pending, self.pending_seconds = {}, 0.0
        if is_due(state.progress.step, self.interval):
            started = time.perf_counter()
            row = {**row, **prefixed(state.handles.val.evaluate(state), PREFIX)}
            seconds += time.perf_counter() - started
        return {**row, "time/val": seconds}
