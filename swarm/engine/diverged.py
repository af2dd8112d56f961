"""A stage's output that is not finite: the training diverged.

Checked where a stage computed it, before it is encoded: the receiving peer would refuse the
payload as malformed (protocols.wire), which says neither where the values came from nor that
the run, not a peer, is at fault; in a swarm an honest peer's NaNs would cost it its neighbours'
trust too.
"""

from __future__ import annotations

import math

import torch

from swarm.engine.microbatch import MicroBatch, Mode


class Diverged(ValueError):
    """NaN or inf in what a stage computed (a ValueError: every command reports it in one line)."""


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite. A NaN or an infinity makes the sum NaN or infinite,
    so a finite sum settles it in one reduction; only a sum that overflowed (or a non-finite
    value) pays for the element-wise test, which allocates a mask as large as the tensor and cost
    a stage peer 13-14% of its CPU on the throughput benchmark's activations (py-spy, 2026-12-02)."""
    if not tensor.is_floating_point() or math.isfinite(tensor.sum().item()):
        return True
    return bool(torch.isfinite(tensor).all())


def require_finite(tensor: torch.Tensor, stage: int, what: str, batch: MicroBatch) -> None:
    """Raises Diverged unless `tensor` (`what`: "activations are", "loss is", ...) is finite. A
    training micro-batch's step is counted from 1, as results rows and progress lines count; an
    evaluation's `step` is the number of steps done."""
    if is_finite(tensor):
        return
    where = (
        f"evaluation micro-batch {batch.index} after step {batch.step}"
        if batch.mode is Mode.EVAL
        else f"micro-batch {batch.index} of step {batch.step + 1}"
    )
    raise Diverged(
        f"stage {stage}: the {what} not finite in {where} (NaN or inf): the training diverged;"
        " a lower optimizer.lr or an optimizer.grad_clip may help"
    )
