"""Weight stashing for an asynchronous stage in a swarm (PipeDream-2BW: two weight versions alive).

A swarm's stage applies step t - 1's update when step t + 1's first micro-batch comes (swarm.engine.
delay), while micro-batches of step t may still be on their way to it: the link order only holds
per sender, and a stage after a replicated one hears from several. So every update goes to fresh
Parameter objects (`renew`) and the objects it replaced stay as the version step t runs at, until
the next update:
- a micro-batch whose forward ran before the update keeps its graph on them (its backward
  differentiates at the weights it ran with, whenever it comes);
- a micro-batch of step t whose forward comes after the update runs at them (`running`), so it
  gives the floats it would have given before the update.
Gradients are held by parameter name (swarm.engine.stage), so they sum onto whichever objects are
current.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

Swaps = list[tuple[torch.nn.Module, str, torch.nn.Parameter]]  # (submodule, attribute, its parameter)


class WeightStash:
    def __init__(self) -> None:
        self.earlier: tuple[int, Swaps] | None = None  # the step the replaced objects serve, and where they were

    def renew(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Fresh Parameter objects (same values, same gradients) for the optimizer to step, the
        replaced ones kept as the version of micro-batches of `step`. Call before the update. Frozen
        parameters never move: both versions share them (a LoRA run's base is not copied)."""
        fresh: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id -> (old, new)
        replaced: Swaps = []
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                if id(p) not in fresh:  # a parameter registered twice (tied within the stage) stays one
                    new = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    new.grad, p.grad = p.grad, None
                    fresh[id(p)] = (p, new)
                sub._parameters[name] = fresh[id(p)][1]
                replaced.append((sub, name, p))
        state = optimizer.state
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in fresh:
                    new = group["params"][i] = fresh[id(p)][1]
                    if p in state:
                        state[new] = state.pop(p)
        self.earlier = (step, replaced)

    def serves(self, step: int) -> bool:
        """Whether the kept version is the one micro-batches of `step` run at."""
        return self.earlier is not None and self.earlier[0] == step

    @contextmanager
    def running(self, step: int) -> Iterator[None]:
        """Inside, a micro-batch of `step` sees the kept version in the module (if it serves `step`),
        the current objects back afterwards."""
        if not self.serves(step):
            yield
            return
        current = [(sub, name, sub._parameters[name]) for sub, name, _ in self.earlier[1]]
        for sub, name, p in self.earlier[1]:
            sub._parameters[name] = p
        try:
            yield
        finally:
            for sub, name, p in current:
                sub._parameters[name] = p

    def forget(self) -> None:
        """The stage's state was replaced (a checkpoint, a copy): no earlier version serves."""
        self.earlier = None
