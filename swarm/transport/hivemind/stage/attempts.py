"""Which attempt of each training micro-batch a stage peer holds the gradients of.

The trainer draws fresh random bytes every time it sends a micro-batch (`MicroBatch.attempt`) and
names, in the gather round, the attempt whose route finished. A stage sums only held gradients of
that attempt: a member that replays a real (step, index), with its own payload, replaces what is
held here but never what is counted; the gather answers STALE and the trainer runs the micro-batch
again. While a new attempt of a micro-batch is under way, its held gradients belong to no attempt
(the new one may replace them at any moment): a gather then finds it stale too, and names the
attempt under way and its sender (a member that keeps starting attempts it never finishes is
named, and left out when the owner never sent them). So does one whose
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
        self._finished_before: dict[tuple, bytes] = {}  # micro-batch key -> the last attempt that finished here
        self._pending: dict[tuple, tuple[bytes, str]] = {}  # micro-batch key -> (attempt under way, sender)

    def started(self, batch: MicroBatch, sender: str) -> None:
        """An attempt of `batch` from `sender` takes over its state here: what is held is nobody's
        for now, and a gather names the attempt under way (one the owner never sent is a replay)."""
        self._held.pop(batch.key, None)
        if batch.mode is Mode.TRAIN:
            self._pending[batch.key] = (batch.attempt, sender)

    def ended(self, batch: MicroBatch) -> None:
        """The attempt under way failed here (its state was dropped)."""
        self._pending.pop(batch.key, None)

    def finished(self, batch: MicroBatch, sender: str) -> None:
        """`batch`'s attempt, from `sender`, finished here: its gradients are the ones held."""
        if batch.mode is not Mode.TRAIN:
            return
        self._pending.pop(batch.key, None)
        if len(self._held) + len(self._pending) >= KEEP:
            self._held = {key: held for key, held in self._held.items() if key[1] >= batch.step}
            self._pending = {key: held for key, held in self._pending.items() if key[1] >= batch.step}
            self._finished_before = {key: a for key, a in self._finished_before.items() if key[1] >= batch.step}
        if self._finished_before.get(batch.key) == batch.attempt:  # a member on its route re-sent it with
            self._held[batch.key] = (b"", sender)  # payload of its own, maybe: the trainer runs it anew
            return
        self._finished_before[batch.key] = batch.attempt
        self._held[batch.key] = (batch.attempt, sender)

    def stale(self, step: int, indices, attempts) -> list[pb.StaleMicroBatch]:
        """Of `step`'s micro-batches `indices`, those whose held gradients are not of the attempt
        named with it in `attempts` (in the same order), with what is held instead and its sender.
        A gather naming no attempts checks none."""
        if not attempts:
            return []
        out = []
        for i, index in enumerate(indices):
            key = (Mode.TRAIN.value, step, index)
            held = self._held.get(key)
            if held is None or i >= len(attempts) or held[0] != attempts[i]:
                shown, sender = held or self._pending.get(key, (b"", ""))
                out.append(pb.StaleMicroBatch(index=index, held=shown, sender=sender))
        return out

    def clear(self) -> None:
        self._held.clear()
        self._pending.clear()
        self._finished_before.clear()
