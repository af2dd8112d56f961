"""What the training loop drives: a pipeline of stages, in one process or over a swarm.

`swarm.transport.local.LocalPipeline` and `swarm.transport.hivemind.trainer.pipeline.SwarmPipeline`
both implement it, so `swarm.training.loop.train` runs either unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from typing import Protocol

import torch

from swarm.engine.microbatch import MicroBatch


class Rewound(Exception):
    """The pipeline went back to an earlier step: it lost a stage and restored the copies the swarm
    kept (`Pipeline.snapshot`). The training loop goes on from `position`, what it handed to
    `snapshot` at that step, and replays the steps since."""

    def __init__(self, position: dict) -> None:
        super().__init__(f"the pipeline went back to step {position.get('step')}")
        self.position = position


class Pipeline(Protocol):
    def run_many(
        self, items: Sequence[tuple[MicroBatch, torch.Tensor]], following: Sequence = ()
    ) -> list[dict[str, float]]:
        """Runs each (micro-batch, inputs) forward and (training) backward; the metrics of each, in
        order. `following` (train.schedule async only): the next step's micro-batches, which the
        pipeline may start before returning; the next call hands them over again and gets theirs."""

    def step(self) -> float:
        """After every micro-batch of a step went backward: the synchronous step; the learning rate it used."""

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent so far per boundary, direction and mode, e.g. 'boundary0.forward.train'."""

    def state_bytes(self) -> int:
        """Bytes of compression state every link end holds."""

    def save_checkpoint(self, directory: str | PathLike, step: int) -> None:
        """Every stage's state (engine.checkpoint's stage files) into `directory`."""

    def load_checkpoint(self, directory: str | PathLike) -> int:
        """Loads what `save_checkpoint` wrote; returns the step it was saved at."""

    def drains(self, step: int) -> bool:
        """Whether the transport needs the pipeline drained after `step` (an asynchronous schedule
        then starts nothing of the next step ahead): a swarm's copies, joiners, codec changes."""

    def snapshot(self, step: int, position: dict) -> None:
        """At a step boundary: every stage's state and the loop's `position` (with its "step") are
        kept where a lost stage or trainer can be restored from (a swarm, every few steps; one
        process keeps none)."""

    def resumed(self) -> dict | None:
        """The position of a run this pipeline took over (a restarted trainer finds its stages in
        the swarm), or None."""

    def step_notes(self) -> dict:
        """Extra fields of a step's results row ({} when the transport has none)."""

    def summary_notes(self) -> dict:
        """Extra fields of the summary row ({} when the transport has none)."""
