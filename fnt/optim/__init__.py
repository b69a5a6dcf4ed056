"""Optimizers: construction from config, the learning-rate setter and the native CPU AdamW."""

from fnt.optim.adamw import CPUAdamW
from fnt.optim.setup import set_lr_, setup_optimizer

__all__ = ["CPUAdamW", "set_lr_", "setup_optimizer"]
