"""Optimizers: construction from config and the learning-rate setter."""

from fnt.optim.setup import set_lr_, setup_optimizer

__all__ = ["set_lr_", "setup_optimizer"]
