"""Per-stage optimizers and learning-rate schedules (each stage owns its own)."""

from __future__ import annotations

import math

import torch

from swarm.config import OptimizerConfig
from swarm.engine.muon import MuonAdamW, muon_groups


def make_optimizer(
    cfg: OptimizerConfig, module: torch.nn.Module, matrices: set[int] | None = None
) -> torch.optim.Optimizer:
    """The stage's optimizer; `matrices`: the ids of its parameters Muon trains (muon only;
    swarm.models.matrices picks them)."""
    params = [p for p in module.parameters() if p.requires_grad]
    # a stage with nothing to train (a LoRA run's stage holding only the frozen embedding) still gets
    # an optimizer: one empty group keeps the schedule, checkpoints and the step's rounds uniform
    if cfg.name == "sgd":  # the paper's ResNet recipe: momentum 0.9, weight decay 5e-4 on everything
        return torch.optim.SGD([{"params": params}], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "muon":
        return MuonAdamW(muon_groups(cfg, params, matrices or set()), cfg)
    # AdamW as HF Trainer sets it up: no decay for biases and norm weights (1-D parameters)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ] or [{"params": []}]
    if cfg.name == "nadam":
        return torch.optim.NAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, decoupled_weight_decay=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def schedule_factor(cfg: OptimizerConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based): linear warm-up, then constant or a
    cosine or linear decay to `min_lr_ratio` of the peak."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress  # linear decay (HF run_clm's, to zero by default)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def make_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule_factor(cfg, step, total_steps))
