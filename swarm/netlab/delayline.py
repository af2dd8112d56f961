"""A stream writer's one-way delay, in process: bytes handed over now are written `delay_s` later, in
the order handed over, while the sender goes on.

That is what a link's propagation does: it delays every byte without holding the sender, who may
put the next payload on the wire at once. Sleeping the delay before writing each payload
(TokenBucket.latency) holds the sender instead, so a peer that sends one payload at a time to a
neighbour (swarm.transport.hivemind.net.calls.Sending) could then send at most one payload per
delay to it, whatever the link's rate: at 50 ms, 20 payloads a second.

    line = DelayLine.of(writer, 0.05)   # the writer's line (one per writer, made on first use)
    line.put(b"...")                    # written 50 ms from now, after what was put before
    await line.flushed()                # everything put so far is written
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque

_LINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DelayLine:
    def __init__(self, writer: asyncio.StreamWriter, delay_s: float) -> None:
        self.writer, self.delay_s = writer, delay_s
        self._queue: deque[tuple[float, bytes | memoryview]] = deque()
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def of(cls, writer: asyncio.StreamWriter, delay_s: float) -> DelayLine:
        line = _LINES.get(writer)
        if line is None:
            line = _LINES[writer] = cls(writer, delay_s)
        return line

    @staticmethod
    def existing(writer: asyncio.StreamWriter) -> DelayLine | None:
        return _LINES.get(writer)

    def put(self, data: bytes | memoryview) -> None:
        """`data` leaves now: it reaches the stream `delay_s` from now (after what was put before)."""
        self._queue.append((time.monotonic() + self.delay_s, data))
        self._idle.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._queue:
                due, data = self._queue[0]
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                self._queue.popleft()
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, RuntimeError, OSError):  # the stream closed: its reader sees that
            self._queue.clear()
        finally:
            if not self._queue:
                self._idle.set()

    async def flushed(self) -> None:
        """Returns once everything put so far is written (or the stream failed)."""
        await self._idle.wait()
