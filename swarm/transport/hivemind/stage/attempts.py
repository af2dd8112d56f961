"""Which attempt of each training micro-batch a stage peer holds the gradients of.

The trainer draws fresh random bytes every time it sends a micro-batch (`MicroBatch.attempt`) and
names, in the gather round, the attempt whose route finished. A stage sums only held gradients of
that attempt: a member that replays a real (step, index), with its own payload, replaces what is
held here but never what is counted; the gather answers STALE and the trainer runs the micro-batch
again. While a new attempt of a micro-batch is under way, its held gradients belong to no attempt
(the new one may replace them at any moment): a gather then finds it stale too. So does one whose
attempt finished here twice: every peer on its route knows the attempt, and one of them may have
sent it again with activations of its own.
"""

from __future__ import annotations

from protocols import stage_pb2 as pb
from swarm.engine.microbatch import MicroBatch, Mode

KEEP = 4096  # micro-batches remembered; past that, those of earlier steps go (their gradients are gone too)


class HeldAttempts:
    def __init__(self) -> None:
        # micro-batch key -> (the attempt its held gradients are of, the peer that sent it)
        self._held: dict[tuple, tuple[bytes, str]] = {}
        self.finished_before: dict[tuple, bytes] = {}  # micro-batch key -> the last attempt that finished here

    def started(self, batch: MicroBatch) -> None:
        """An attempt of `batch` takes over its state here: what is held is nobody's for now."""
        self._held.pop(batch.key, None)

    def finished(self, batch: MicroBatch, sender: str) -> None:
        """`batch`'s attempt, from `sender`, finished here: its gradients are the ones held."""
        if batch.mode is not Mode.TRAIN:
            return
        if len(self._held) >= KEEP:
            self._held = {key: held for key, held in self._held.items() if key[1] >= batch.step}
            self.finished_before = {key: a for key, a in self.finished_before.items() if key[1] >= batch.step}
        if self.finished_before.get(batch.key) == batch.attempt:  # a member on its route re-sent it with
            self._held[batch.key] = (b"", sender)  # payload of its own, maybe: the trainer runs it anew
            return
        self.finished_before[batch.key] = batch.attempt
        self._held[batch.key] = (batch.attempt, sender)

    def stale(self, step: int, indices, attempts) -> list[pb.StaleMicroBatch]:
        """Of `step`'s micro-batches `indices`, those whose held gradients are not of the attempt
        named with it in `attempts` (in the same order), with what is held instead and its sender.
        A gather naming no attempts checks none."""
        if not attempts:
            return []
        out = []
        for i, index in enumerate(indices):
            held, sender = self._held.get((Mode.TRAIN.value, step, index), (b"", ""))
            if i >= len(attempts) or held != attempts[i]:
                out.append(pb.StaleMicroBatch(index=index, held=held, sender=sender))
        return out

    def clear(self) -> None:
        self._held.clear()
        self.finished_before.clear()
