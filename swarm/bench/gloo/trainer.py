"""The trainer's rank of the gloo baseline: a `Pipeline` the training loop drives unchanged.

It hands micro-batches to stage 0 (at most `in_flight` in the pipeline, as the swarm's trainer
does), collects each one's metrics when it is done (training: from stage 0 after its backward;
evaluation: from the last stage), and runs the synchronous step (swarm.engine.step) as three
rounds of messages to every stage.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from swarm.bench.gloo.mailbox import Mailbox
from swarm.bench.gloo.stage import rank_of
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.engine.step import Grads, synchronous_step


def own_storage(batch: MicroBatch, inputs: torch.Tensor) -> tuple[MicroBatch, torch.Tensor]:
    """The micro-batch's tensors in storage of their own: a micro-batch split off a batch is a view,
    and pickle would send the whole batch's storage with every micro-batch (its targets then
    travel along to every stage)."""
    return replace(batch, sample_ids=batch.sample_ids.clone(), targets=batch.targets.clone()), inputs.clone()


class GlooPipeline:
    def __init__(self, mailbox: Mailbox, stages: int, in_flight: int, tied=(), grad_clip: float | None = None) -> None:
        self.mailbox, self.stages, self.in_flight = mailbox, stages, in_flight
        self.tied, self.grad_clip = list(tied), grad_clip
        self.step_keys: list[tuple] = []  # this step's training micro-batches, in order
        self.bytes: dict[int, dict[str, int]] = {}  # per stage: its link ends' bytes sent so far
        self.totals: dict[int, dict] = {}  # per stage: its compute so far

    def run_many(self, items) -> list[dict[str, float]]:
        done: dict[tuple, dict] = {}
        waiting = list(items)
        out = 0
        while waiting or out:
            while waiting and out < self.in_flight:
                batch, inputs = waiting.pop(0)
                if batch.mode is Mode.TRAIN:
                    self.step_keys.append(batch.key)
                self.mailbox.send(rank_of(0), ("forward", *own_storage(batch, inputs)))
                out += 1
            _, (kind, key, metrics) = self._next("done")
            done[key] = metrics
            out -= 1
        return [done[batch.key] for batch, _ in items]

    def _next(self, expected: str) -> tuple[int, tuple]:
        source, message = self.mailbox.receive()
        if message[0] != expected:
            raise RuntimeError(f"rank {source} answered {message[0]!r} where {expected!r} was due")
        return source, message

    def _round(self, kind: str, per_stage) -> dict[int, object]:
        """Sends every stage its part of a round; each stage's answer."""
        for stage in range(self.stages):
            self.mailbox.send(rank_of(stage), (kind, *per_stage(stage)))
        answers = {}
        for _ in range(self.stages):
            _, (_, stage, answer) = self._next(kind)
            answers[stage] = answer
        return answers

    # ---- the synchronous step, its rounds as messages ----------------------------------------------

    def step(self) -> float:
        lr = synchronous_step(self, self.tied, self.grad_clip)
        self.step_keys = []
        return lr

    def gather(self, wanted: dict[int, list[str]]) -> Grads:
        answers = self._round("gather", lambda stage: (wanted.get(stage, []), self.step_keys))
        return {stage: grads for stage, grads in answers.items() if stage in wanted}

    def replicated(self, stage: int) -> bool:
        return False

    def set_gradients(self, grads: Grads, norm: bool) -> float:
        answers = self._round("set", lambda stage: (grads.get(stage, {}), norm))
        return sum(answers[stage] for stage in range(self.stages))  # in stage order, as in one process

    def apply(self, scale: float) -> float:
        answers = self._round("apply", lambda stage: (scale,))
        for stage, answer in answers.items():
            self.bytes[stage], self.totals[stage] = answer["bytes"], answer["totals"]
        return answers[0]["lr"]

    def stop(self) -> None:
        for stage in range(self.stages):
            self.mailbox.send(rank_of(stage), ("stop",))
        for _ in range(self.stages):
            self._next("stopped")

    # ---- accounting ------------------------------------------------------------------------------

    def link_bytes(self) -> dict[str, int]:
        """As of the last step: what each stage reported with its `apply` answer."""
        totals: Counter = Counter()
        for sent in self.bytes.values():
            totals.update(sent)
        return dict(sorted(totals.items()))

    def state_bytes(self) -> int:
        return 0  # uncompressed: no error-feedback state

    def step_notes(self) -> dict:
        """Each stage's compute so far, as the swarm's step rows give it (bench throughput's compute bound)."""
        return {"stages": [{"stage": stage, **self.totals[stage]} for stage in sorted(self.totals)]}

    def summary_notes(self) -> dict:
        return {"transport": "torch.distributed gloo"}

    def save_checkpoint(self, directory, step: int) -> None:
        raise ValueError("the gloo baseline keeps no checkpoints")

    def load_checkpoint(self, directory) -> int:
        raise ValueError("the gloo baseline keeps no checkpoints")

    def drains(self, step: int) -> bool:
        return False

    def snapshot(self, step: int, position: dict) -> None:
        """A benchmark baseline: nothing is kept for a restore."""

    def resumed(self) -> dict | None:
        return None
