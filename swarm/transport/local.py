"""The in-process transport: every stage in this process, messages still encoded to bytes.

Micro-batches run one after another (forward through all stages, then backward); with
synchronous steps that is the same computation any schedule performs, and it makes runs
deterministic. Bytes and numerics are exactly what the network would carry.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from swarm.engine.microbatch import Kind, MicroBatch
from swarm.engine.stage import StageRuntime


class LocalPipeline:
    def __init__(self, runtimes: list[StageRuntime], tied=(), grad_clip: float | None = None) -> None:
        self.runtimes = runtimes
        self.tied = list(tied)  # TiedPairs: one parameter held by two stages
        self.grad_clip = grad_clip

    def run(self, batch: MicroBatch, inputs: torch.Tensor) -> dict[str, float]:
        """One micro-batch through the pipeline (and back when training); its metrics."""
        message = self.runtimes[0].forward(batch, inputs)
        try:
            while message.kind is not Kind.DONE:
                stage = self.runtimes[message.to_stage]
                if message.kind is Kind.FORWARD:
                    following = stage.forward(batch, message.payload)
                else:
                    following = stage.backward(batch, message.payload, message.metrics)
                message.delivered()
                message = following
        except Exception:
            for runtime in self.runtimes:
                runtime.drop(batch)
            raise
        return message.metrics

    def run_many(self, items) -> list[dict[str, float]]:
        """(micro-batch, inputs) pairs one after another: the swarm's order, without the overlap."""
        return [self.run(batch, inputs) for batch, inputs in items]

    def step(self) -> float:
        """After every micro-batch of a step went backward: tie, clip, and step every stage."""
        modules = [r.module for r in self.runtimes]
        if self.tied:
            from swarm.models import sync_tied_gradients

            sync_tied_gradients(modules, self.tied)
        if self.grad_clip is not None:
            squares = sum(r.grad_sq_norm() for r in self.runtimes)
            for pair in self.tied:  # a tied parameter counts once, as in the unsplit model
                stage, name = pair.second
                grad = modules[stage].get_parameter(name).grad
                squares -= 0.0 if grad is None else float(grad.detach().float().pow(2).sum())
            norm = math.sqrt(max(squares, 0.0))
            if norm > self.grad_clip:
                for r in self.runtimes:
                    r.scale_grads(self.grad_clip / (norm + 1e-6))
        lrs = [r.apply_step() for r in self.runtimes]
        return lrs[0]

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent per boundary, direction and mode, e.g. 'boundary0.forward.train'."""
        totals: Counter = Counter()
        for r in self.runtimes:
            for end in (r.inbound, r.outbound):
                if end is None:
                    continue
                for (mode, direction), n in end.bytes.items():
                    totals[f"boundary{end.boundary}.{direction}.{mode}"] += n
        return dict(sorted(totals.items()))

    def state_bytes(self) -> int:
        return sum(r.state_bytes() for r in self.runtimes)

    def save_checkpoint(self, directory, step: int) -> None:
        """One file per stage, `stage<i>.pt`, in `directory`."""
        from swarm.engine.checkpoint import save_stage

        for r in self.runtimes:
            save_stage(r, f"{directory}/stage{r.index}.pt", step)

    def load_checkpoint(self, directory) -> int:
        """Load every stage's file from `directory`; returns the step they were saved at."""
        from swarm.engine.checkpoint import load_stage
        from swarm.transport.hivemind.trainer.adaptive import checkpoint_codecs

        checkpoint_codecs(
            directory, adaptive=False
        )  # refuses an adaptive swarm's checkpoint: one process has fixed codecs
        steps = {load_stage(r, f"{directory}/stage{r.index}.pt") for r in self.runtimes}
        if len(steps) != 1:
            raise ValueError(f"checkpoint {directory} mixes stages saved at steps {sorted(steps)}")
        return steps.pop()
