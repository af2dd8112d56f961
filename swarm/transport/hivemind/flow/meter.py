"""How fast a link delivers: bytes over the seconds payloads were arriving on it.

Both directions are timed where they arrive (the receiver's clock; a sender's writes may return
long before the bytes are through, into socket buffers):
- a request (activations) from its first byte (the sender writes as soon as its send slot is
  free; streams.Requests) to its last chunk: the whole payload over its whole transfer;
- a reply (gradients) comes back on the caller's stream after the callee's compute, so its start
  is not seen; it is timed from its first chunk to its last, counting the bytes after the first
  chunk. Exact for replies of several chunks (framing.CHUNK_BYTES each); a one-chunk reply adds
  nothing (the trainer then assumes the link's other direction's rate).
Transfers that overlap count their common time once, so bytes / busy seconds is what the link
carried while it was busy, shared with whatever else crossed it: the bandwidth adaptive
compression plans with.
"""

from __future__ import annotations

import time

from protocols.framing import Received


class LinkMeter:
    def __init__(self) -> None:
        self.nbytes = 0
        self.busy_s = 0.0
        self._until = float("-inf")  # end of the latest transfer counted

    def add(self, started: float, finished: float, nbytes: int) -> None:
        """One payload (monotonic seconds). Transfers are added as they finish, so only the part of
        this one after the latest finish so far is new busy time (gaps before it are not
        revisited: a slight undercount when transfers finish out of order)."""
        self.nbytes += nbytes
        new = finished - max(started, self._until)
        if new > 0:
            self.busy_s += new
        self._until = max(self._until, finished)


async def timed_chunks(messages, meter: LinkMeter, clock=time.monotonic):
    """Passes `messages` (framed replies, protobuf or `framing.Received`) through, adding each payload's chunks after the first to
    `meter` once its last chunk is in (the reader stops there, so nothing waits for the stream's end).
    Payloads of two chunks or less are not timed: the second may hold only a few bytes, and few
    bytes over the gap between two arrivals says nothing about the link."""
    first = None
    nbytes = 0
    async for item in messages:
        now = clock()
        message, data = Received.of(item)
        if message.HasField("chunk"):
            chunk = message.chunk
            if chunk.index == 0:
                first, nbytes = now, 0
            else:
                nbytes += len(chunk.data if data is None else data)
            if chunk.index + 1 == chunk.count and first is not None:
                if chunk.count > 2:  # at least one whole chunk after the first: a last chunk may be a few bytes
                    meter.add(first, now, nbytes)
                first = None
        yield item
