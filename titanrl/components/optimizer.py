import math

import torch
from torch import nn

from titanrl.config.training import LRScheduler as LRSchedulerConfig
from titanrl.config.training import Optimizer as OptimizerConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over all trainable parameters (plain, FSDP2 or TP DTensors alike)."""
    params = [p for p in model.parameters() if p.requires_grad]
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[
        config.implementation
    ]
    if config.name == "SGD":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay, **impl)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[config.name]
    return cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        **impl,
    )


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.decay_type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    if config.decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: LRSchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
