"""Which attempt of each training micro-batch a stage peer holds the gradients of.

The trainer draws fresh random bytes every time it sends a micro-batch (`MicroBatch.attempt`) and
names, in the gather round, the attempt whose route finished. A stage sums only held gradients of
that attempt: a member that replays a real (step, index), with its own payload, replaces what is
held here but never what is counted; the gather answers STALE and the trainer runs the micro-batch
again. While a new attempt of a micro-batch is under way, its held gradients belong to no attempt
(the new one may replace them at any moment): a gather then finds it stale too.
"""

from __future__ import annotations

from swarm.engine.microbatch import MicroBatch, Mode

KEEP = 4096  # micro-batches remembered; past that, those of earlier steps go (their gradients are gone too)


class HeldAttempts:
    def __init__(self) -> None:
        self._held: dict[tuple, bytes] = {}  # micro-batch key -> the attempt its held gradients are of

    def started(self, batch: MicroBatch) -> None:
        """An attempt of `batch` takes over its state here: what is held is nobody's for now."""
        self._held.pop(batch.key, None)

    def finished(self, batch: MicroBatch) -> None:
        """`batch`'s attempt finished here: its gradients are the ones held."""
        if batch.mode is not Mode.TRAIN:
            return
        if len(self._held) >= KEEP:
            self._held = {key: tag for key, tag in self._held.items() if key[1] >= batch.step}
        self._held[batch.key] = batch.attempt

    def stale(self, step: int, indices, attempts) -> list[int]:
        """Of `step`'s micro-batches `indices`, those whose held gradients are not of the attempt
        named with it in `attempts` (in the same order). A gather naming no attempts checks none."""
        if not attempts:
            return []
        return [
            index
            for index, attempt in zip(indices, attempts, strict=False)
            if self._held.get((Mode.TRAIN.value, step, index)) != attempt
        ] + list(indices[len(attempts) :])

    def clear(self) -> None:
        self._held.clear()
