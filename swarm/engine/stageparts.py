"""What a stage runtime (swarm.engine.stage) is built from, in the pieces that travel together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainedModule:
    """A stage's module with the optimizer that steps it and its learning-rate schedule (or None)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object = None


@dataclass(frozen=True)
class Objective:
    """The last stage's loss of (logits, targets), and its metrics (a name -> value dict) or None."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None = None
