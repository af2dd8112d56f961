"""`train.schedule: async`: every step applies the gradients of the step before it.

With a synchronous step the weights v_{t+1} = opt(v_t, g_t(v_t)): a step's update needs all of its
micro-batches back, so the pipeline drains at every step boundary and, over slow links, fills again
(docs/bench/README.md "Where the time goes at 50 ms"). With a delay of one step (PipeDream-2BW's
weight updates) v_{t+1} = opt(v_t, g_{t-1}(v_{t-1})): step t+1's micro-batches need only step t-1's
gradients, so they may enter while step t's are still in flight. The first step applies nothing.

Each stage keeps the gradients of its last step (`StageDelay`, part of its checkpoint) and swaps
them in before the step's update, so the update itself (clipping, tied parameters, the optimizer and
its schedule: swarm.engine.step) is the synchronous one, on the step-old gradients.

A delay correction (`train.delay_correction`) makes up for the weights having moved since the
gradients were computed:
- `none`: the gradients as computed;
- `lookahead`: a step's training micro-batches run at the weights the step's own gradients will be
  applied to, as predicted from the last update (v_t + (v_t - v_{t-1}): weight prediction, as
  SpecTrain's and, in spirit, the Nesterov look-ahead of Pluralis' asynchronous pipeline); the
  weights between steps (evaluations, checkpoints) stay v_t;
- `dc:LAMBDA`: delay-compensated gradients (DC-ASGD, Zheng et al., ICML 2017):
  g + LAMBDA * g * g * (v_now - v_then), the gradient's first-order change along the weights' move
  with the Hessian approximated by g*g (its outer product's diagonal).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swarm.config.schedule import DelayCorrection


def synchronous_only(schedule: str, where: str) -> None:
    """Refuses `train.schedule: async` where it is not built yet, in one line."""
    if schedule != "sync":
        raise ValueError(
            f"train.schedule: {schedule} runs in one process so far (python -m swarm run); {where} runs train.schedule: sync"
        )


def compensated(grad: torch.Tensor, now: torch.Tensor, then: torch.Tensor, strength: float) -> torch.Tensor:
    """dc: g + LAMBDA g*g (v_now - v_then), in this order of operations (a swarm's stage computes it
    too, and must get the same floats)."""
    return grad + strength * grad * grad * (now - then)


def predict_(weights: torch.Tensor, move: torch.Tensor) -> torch.Tensor:
    """lookahead: `weights` (in place) become the predicted v + moved."""
    return weights.add_(move)


class StageDelay:
    """One stage's gradients of its last step, applied a step late."""

    def __init__(self, correction: DelayCorrection) -> None:
        self.correction = correction
        self.kept: dict[str, torch.Tensor] | None = None  # parameter name -> the last step's gradient
        self.then: dict[str, torch.Tensor] | None = None  # ... and the weights it was computed at (dc)
        self.before: dict[str, torch.Tensor] | None = None  # the weights before the last update (lookahead)
        self.moved: dict[str, torch.Tensor] | None = None  # ... and what that update moved them by

    def swap(self, module: torch.nn.Module) -> bool:
        """Before the step's update: the parameters' gradients become the last step's (corrected)
        and the step's own are kept for the next; False when there is nothing to apply yet."""
        params = dict(module.named_parameters())
        current = {name: p.grad.detach().clone() for name, p in params.items() if p.grad is not None}
        weights = {name: params[name].detach().clone() for name in current} if self.correction.kind == "dc" else None
        kept, then = self.kept, self.then
        self.kept, self.then = current, weights
        for p in params.values():
            p.grad = None
        if kept is None:
            return False
        self.updating(module, kept)
        for name, grad in kept.items():
            if then is not None:
                grad = compensated(grad, params[name].detach(), then[name], self.correction.strength)
            params[name].grad = grad
        return True

    def updating(self, module: torch.nn.Module, names) -> None:
        """Before an update of the parameters `names`: lookahead keeps the weights it starts from."""
        if self.correction.kind == "lookahead":
            params = dict(module.named_parameters())
            self.before = {name: params[name].detach().clone() for name in names}

    def applied(self, module: torch.nn.Module) -> None:
        """After the step's update: what it moved the weights by (lookahead's prediction)."""
        if self.before is not None:
            params = dict(module.named_parameters())
            self.moved = {name: params[name].detach() - weights for name, weights in self.before.items()}
            self.before = None

    @contextmanager
    def ahead(self, module: torch.nn.Module) -> Iterator[None]:
        """lookahead: the step's training micro-batches run at the predicted weights v + moved; the
        weights are v again afterwards, exactly (restored, not subtracted)."""
        if self.moved is None:
            yield
            return
        params = dict(module.named_parameters())
        kept = {name: params[name].detach().clone() for name in self.moved}
        with torch.no_grad():
            for name, move in self.moved.items():
                predict_(params[name], move)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, weights in kept.items():
                    params[name].copy_(weights)

    def state_dict(self) -> dict:
        return {"kept": self.kept, "then": self.then, "moved": self.moved}

    def load_state_dict(self, state: dict) -> None:
        self.kept, self.then, self.moved = state["kept"], state["then"], state.get("moved")
