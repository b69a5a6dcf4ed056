"""Optimizers: construction from config, the learning-rate setter and the native CPU AdamW.
Side effects: those of setup and adamw (optimizer state created, parameters and learning rates
set in place, the native kernel built on first use) and offload's CPU binding; this file only
re-exports them."""

from fnt.optim.adamw import CPUAdamW
from fnt.optim.setup import set_lr_, setup_optimizer

__all__ = ["CPUAdamW", "set_lr_", "setup_optimizer"]
