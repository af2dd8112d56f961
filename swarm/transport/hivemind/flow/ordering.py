"""Keeping the order that mirrored compression state depends on, with several micro-batches in flight.

Error feedback with global state (EF, EF21) changes with every message, so both ends of a link
must process that link's messages in the same order: the sender numbers them (`OutLink`), the
receiver admits them in that order (`Turnstile`). A sender that lost track of a link (a failed
call) starts a new epoch; the receiver resets its end when the new epoch's first message comes
and refuses what is left of the old one. Gradients accumulate, and gradient messages go back, in
the order the forwards ran (`Ordinals`), which keeps the backward direction in link order too.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError


class LinkReset(RemoteError):
    """A message from an epoch this end has left behind, or one whose turn never came."""

    def __init__(self, message: str) -> None:
        super().__init__(message, pb.LINK_RESET)


def new_epoch() -> int:
    """Epochs only grow, also across restarts of the sender (a restarted peer starts a new one)."""
    return time.time_ns()


@dataclass
class OutLink:
    """The sending side's numbering of one link."""

    epoch: int = field(default_factory=new_epoch)
    seq: int = 0

    def take(self) -> tuple[int, int]:
        """(epoch, seq) for the next message; call in the order messages are encoded."""
        self.seq += 1
        return self.epoch, self.seq - 1

    def reset(self) -> None:
        self.epoch, self.seq = max(new_epoch(), self.epoch + 1), 0


class Numbering:
    """A sender's numbering of its links, one `OutLink` per receiver."""

    def __init__(self) -> None:
        self._links: dict[str, OutLink] = {}

    def take(self, peer_id: str) -> tuple[int, int]:
        """(epoch, seq) for the next message to `peer_id`; call in the order messages are encoded."""
        return self._links.setdefault(peer_id, OutLink()).take()

    def restart(self, peer_id: str) -> None:
        """The link to `peer_id` lost its order or state: its next message starts a new epoch."""
        self._links.setdefault(peer_id, OutLink()).reset()

    def epoch(self, peer_id: str) -> int | None:
        link = self._links.get(peer_id)
        return None if link is None else link.epoch

    def clear(self) -> None:
        self._links.clear()


class Turnstile:
    """The receiving side: admits one sender's messages one at a time, in (epoch, seq) order."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.next = 0
        self.busy = False
        self._changed = asyncio.Condition()

    def _stale(self, epoch: int) -> bool:
        return self.epoch is not None and epoch < self.epoch

    def _my_turn(self, epoch: int, seq: int) -> bool:
        if self.busy:
            return False
        if epoch == self.epoch:
            return seq == self.next
        return seq == 0 and not self._stale(epoch)

    @asynccontextmanager
    async def admit(self, epoch: int, seq: int, timeout: float, grace: float):
        """Waits for the message's turn; yields True when it starts a new epoch (reset the link end).

        A later message of an epoch this end has not seen waits at most `grace` seconds for that
        epoch's first one: past that, this end lost the link (it restarted) and says so."""
        started = time.monotonic()
        async with self._changed:
            try:
                if epoch != self.epoch and seq > 0:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._stale(epoch) or self.epoch == epoch), min(grace, timeout)
                    )
                left = max(timeout - (time.monotonic() - started), 0.0)
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._stale(epoch) or self._my_turn(epoch, seq)), left
                )
            except TimeoutError:
                raise LinkReset(
                    f"message {seq} of link epoch {epoch} found no turn (this end expects message {self.next} of epoch {self.epoch})"
                ) from None
            if self._stale(epoch):
                raise LinkReset(f"message from link epoch {epoch}, which was reset (now epoch {self.epoch})")
            fresh = epoch != self.epoch
            self.epoch, self.next, self.busy = epoch, seq + 1, True
        try:
            yield fresh
        finally:
            async with self._changed:
                self.busy = False
                self._changed.notify_all()


class Ordinals:
    """Tickets in forward order; a ticket's backward waits until every earlier ticket is done."""

    def __init__(self) -> None:
        self.issued = 0
        self.done_below = 0  # every ticket below this is done
        self._done: set[int] = set()
        self._changed = asyncio.Condition()

    def issue(self) -> int:
        self.issued += 1
        return self.issued - 1

    @asynccontextmanager
    async def turn(self, ticket: int, timeout: float):
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.done_below == ticket), timeout)
            except TimeoutError:  # an earlier one is stuck further down: this one may simply go again
                raise RemoteError(
                    f"backward {ticket} waited {timeout:.1f}s for earlier micro-batches ({self.done_below} is not done)",
                    pb.DOWNSTREAM,
                ) from None
        try:
            yield
        finally:
            await self.finish(ticket)

    async def finish(self, ticket: int) -> None:
        """Marks a ticket done (also one whose micro-batch failed); idempotent."""
        async with self._changed:
            if ticket >= self.done_below:
                self._done.add(ticket)
            while self.done_below in self._done:
                self._done.remove(self.done_below)
                self.done_below += 1
            self._changed.notify_all()
