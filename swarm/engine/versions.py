"""A swarm stage's weights per open step, for a delay correction (swarm.engine.delay).

In one process a step's micro-batches all run between two updates, so `StageDelay` takes what a
correction needs once per step, at the step's end. A swarm's stage has two steps open at once (step
t + 1's micro-batches enter before step t is applied: swarm.transport.hivemind.trainer.late), so it
takes it per step, when the step's first training micro-batch comes: the weights are then those all
of the step's micro-batches run at here (v_t: step t - 1 is applied only when step t + 1's first
micro-batch comes), as one process's are during its step.
- dc: a clone of v_t, the v_then of step t's gradients when they are applied (their v_now: the
  weights at that apply, v_{t+1}, as in one process's `swap` at step t + 1's end). A replica of a
  stage may run none of step t's micro-batches and still compensate the replicas' sum of them
  (swarm.transport.hivemind.stage.combine): so the stage also takes v_t whenever its weights come
  to serve step t (`serves`: at the start, after each update, after a restore);
- lookahead: the predicted weights v_t + moved as Parameter objects of their own, which the step's
  forwards use instead of the module's (and so their backwards, whenever they come: the graphs hold
  them); the module's own stay v_t, for the update and evaluations.
The arithmetic and `moved` are StageDelay's, so a swarm's floats are one process's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swarm.engine.delay import StageDelay, compensated, predict_


class StepVersions:
    """What a delay correction keeps per open step of a swarm's stage (keyed by step)."""

    def __init__(self, delay: StageDelay) -> None:
        self.delay = delay
        self.then: dict[int, dict[str, torch.Tensor]] = {}  # dc: step -> the weights it runs at
        self.ahead: dict[int, dict[str, torch.nn.Parameter]] = {}  # lookahead: step -> its predicted weights

    def entered(self, step: int, module: torch.nn.Module) -> None:
        """A training micro-batch of `step` is about to run here: the first takes the step's version
        (where `serves` did not: a state of its own, as a test's)."""
        kind = self.delay.correction.kind
        if kind == "none" or step in self.then or step in self.ahead:
            return
        params = dict(module.named_parameters())
        if kind == "dc":  # what trains only, as one process's StageDelay (a LoRA run's base never moves)
            self.then[step] = {name: p.detach().clone() for name, p in params.items() if p.requires_grad}
        else:
            self.ahead[step] = self._predicted(params)

    def _predicted(self, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Parameter]:
        """lookahead: the weights after the last move once more (nothing to predict from before the
        first update: every micro-batch of the step alike)."""
        return {
            name: torch.nn.Parameter(predict_(params[name].detach().clone(), move), params[name].requires_grad)
            for name, move in (self.delay.moved or {}).items()
        }

    def serves(self, steps, module: torch.nn.Module) -> None:
        """The module's weights are now those micro-batches of `steps` run at (v_t): dc takes them,
        lookahead predicts from them, for each step it has none of yet. Taken now, not at the step's
        first micro-batch here: that may come after the next update (swarm.engine.stash)."""
        kind = self.delay.correction.kind
        if kind == "lookahead":
            for step in [s for s in steps if s not in self.ahead]:
                self.ahead[step] = self._predicted(dict(module.named_parameters()))
        steps = [s for s in steps if s not in self.then]
        if kind != "dc" or not steps:
            return
        weights = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
        for step in steps:
            self.then[step] = weights

    @contextmanager
    def running(self, step: int, module: torch.nn.Module) -> Iterator[None]:
        """A training micro-batch of `step` runs inside: with lookahead, at the step's predicted
        weights (its Parameter objects in the module's place, the module's own back afterwards)."""
        self.entered(step, module)
        predicted = self.ahead.get(step)
        if not predicted:
            yield
            return
        by_id = {id(p): predicted[name] for name, p in module.named_parameters() if name in predicted}
        swapped = []  # (submodule, attribute, its own parameter): a parameter registered twice swaps twice
        for sub in module.modules():
            for attribute, p in list(sub._parameters.items()):
                if p is not None and id(p) in by_id:
                    swapped.append((sub, attribute, p))
                    sub._parameters[attribute] = by_id[id(p)]
        try:
            yield
        finally:
            for sub, attribute, p in swapped:
                sub._parameters[attribute] = p

    def corrected(self, step: int, module: torch.nn.Module, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`sums` (step `step`'s gradients by name) as they are applied now: dc's, at the current
        weights; the others' as they are. KeyError when dc has no weights of the step (it never ran here)."""
        if self.delay.correction.kind != "dc":
            return sums
        then = self.then.get(step)
        if then is None:
            raise KeyError(f"no weights of step {step} to compensate its gradients with")
        params = dict(module.named_parameters())
        strength = self.delay.correction.strength
        return {name: compensated(g, params[name].detach(), then[name], strength) for name, g in sums.items()}

    def weights_of(self, step: int) -> dict[str, torch.Tensor] | None:
        """dc: the weights `step` ran at (a drained stage's checkpoint writes them as one process's
        `StageDelay.then` of its kept gradients); None without dc."""
        return self.then.get(step)

    def hold_weights(self, step: int, then: dict[str, torch.Tensor] | None) -> None:
        """The inverse of `weights_of`, once a checkpoint or copy holding `step`'s gradients is installed."""
        if then is not None:
            self.then[step] = then

    def updating(self, module: torch.nn.Module, names) -> None:
        self.delay.updating(module, names)

    def applied(self, step: int, module: torch.nn.Module) -> None:
        """After the update applying step `step`: lookahead's `moved`; that step's versions go."""
        self.delay.applied(module)
        self.then = {s: v for s, v in self.then.items() if s > step}
        self.ahead = {s: v for s, v in self.ahead.items() if s > step}

    def forget(self) -> None:
        """The stage's state was replaced (a checkpoint): no step is open."""
        self.then, self.ahead = {}, {}
