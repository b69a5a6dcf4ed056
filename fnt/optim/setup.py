"""Building the optimizer from config. Side effect: creates optimizer state for the model.

`setup_optimizer` is the one place that reads the implementation and offload settings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fnt.config import ConfigError, ModelConfig, OptimConfig


def setup_optimizer(
    optim_config: OptimConfig, model: nn.Module, parallel_dims: Any, model_config: ModelConfig
) -> torch.optim.Optimizer:
    """AdamW or SGD over the model's trainable parameters."""
    if optim_config.offload != "none":
        raise ConfigError(
            f"'optim.offload' = {optim_config.offload!r} is not implemented yet; use \"none\""
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if optim_config.name == "sgd":
        if optim_config.impl != "torch":
            raise ConfigError(
                f"'optim.impl' = {optim_config.impl!r} applies to adamw only; "
                'use "torch" with sgd'
            )
        return torch.optim.SGD(
            params,
            lr=optim_config.lr,
            momentum=optim_config.momentum,
            weight_decay=optim_config.weight_decay,
        )
    if optim_config.impl != "torch":
        raise ConfigError(
            f"'optim.impl' = {optim_config.impl!r} is not implemented yet; use \"torch\""
        )
    return torch.optim.AdamW(
        params,
        lr=optim_config.lr,
        betas=optim_config.betas,
        eps=optim_config.eps,
        weight_decay=optim_config.weight_decay,
    )


def set_lr_(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
