"""Step functions: `(TrainState, batch) -> (TrainState, metrics)`, one optimizer update each.
Side effects: each step's (forward and backward passes, collectives, the optimizer update in
place on the state's handles: steps.sft, steps.rl, steps.dpo); this file only re-exports them.

`from steps import sft_step, rl_step, dpo_step`; the fnt library never imports this package.
"""

from steps.dpo import dpo_step
from steps.rl import rl_step
from steps.sft import sft_step

__all__ = ["dpo_step", "rl_step", "sft_step"]
