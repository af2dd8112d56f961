"""A stage's output that is not finite: the training diverged.

Checked where a stage computed it, before it is encoded: the receiving peer would refuse the
payload as malformed (protocols.wire), which says neither where the values came from nor that
the run, not a peer, is at fault; in a swarm an honest peer's NaNs would cost it its neighbours'
trust too.
"""

from __future__ import annotations

import torch

from swarm.engine.microbatch import MicroBatch


class Diverged(ValueError):
    """NaN or inf in what a stage computed (a ValueError: every command reports it in one line)."""


def require_finite(tensor: torch.Tensor, stage: int, what: str, batch: MicroBatch) -> None:
    """Raises Diverged unless `tensor` is finite; its step is counted from 1, as results rows and progress lines count."""
    if not bool(torch.isfinite(tensor).all()):
        raise Diverged(
            f"stage {stage}: the {what} of micro-batch {batch.index} of step {batch.step + 1} are not finite"
            " (NaN or inf): the training diverged; a lower optimizer.lr or an optimizer.grad_clip may help"
        )
