"""Step functions: `(TrainState, batch) -> (TrainState, metrics)`, one optimizer update each.

`from steps import sft_step, rl_step, dpo_step`; the fnt library never imports this package.
"""

from steps.dpo import dpo_step
from steps.rl import rl_step
from steps.sft import sft_step

__all__ = ["dpo_step", "rl_step", "sft_step"]
