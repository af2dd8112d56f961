"""What travels with a micro-batch between stages (besides the compressed tensor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from protocols.errors import PayloadError


class Mode(StrEnum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: its place in the schedule, sample ids and targets (labels travel along).

    `weight` scales the loss so micro-batch gradients add up to the batch mean.
    `exact` sends uncompressed tensors (warmup epochs, uncompressed evaluation).
    `attempt` tells apart the times a swarm's trainer sent it (not part of its key).
    """

    step: int
    index: int
    sample_ids: torch.Tensor
    targets: torch.Tensor
    mode: Mode = Mode.TRAIN
    weight: float = 1.0
    exact: bool = False
    attempt: bytes = b""

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.mode.value, self.step, self.index)

    @property
    def label(self) -> str:
        """The micro-batch as a trace shows it: mode/step/index."""
        return f"{self.mode.value}/{self.step}/{self.index}"

    @property
    def size(self) -> int:
        return int(self.sample_ids.numel())

    def check_input(self, shape) -> None:
        """Raises PayloadError unless a stage input of `shape` (stage 0's input, or the activations
        a message carries, checked before they are decoded) and the targets have a row per sample."""
        shape = tuple(shape)
        if not shape or shape[0] != self.size or self.targets.shape[:1] != (self.size,):
            raise PayloadError(
                f"micro-batch {self.key}: input of shape {shape} and targets of shape {tuple(self.targets.shape)} for {self.size} samples"
            )


class Kind(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    DONE = "done"  # the micro-batch is finished: training loss/metrics or evaluation metrics


@dataclass
class Message:
    """A stage's output: where it goes next and what it carries."""

    kind: Kind
    to_stage: int
    batch: MicroBatch
    payload: bytes = b""
    metrics: dict[str, float] = field(default_factory=dict)
    delivered: Callable[[], None] = field(default=lambda: None, repr=False)  # commits sender state
