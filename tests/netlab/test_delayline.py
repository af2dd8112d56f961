"""The in-process one-way delay (swarm.netlab.delayline): bytes reach the stream after the delay,
in order, and the sender is never held."""

from __future__ import annotations

import asyncio
import socket
import time

from swarm.netlab.delayline import DelayLine


async def _pair():
    """A reader and a writer joined by a socket pair (the other ends kept: dropped, they would close)."""
    left, right = socket.socketpair()
    reader, kept_writer = await asyncio.open_connection(sock=left)
    kept_reader, writer = await asyncio.open_connection(sock=right)
    _pair.kept = (kept_writer, kept_reader)
    return reader, writer


def test_bytes_arrive_a_delay_after_they_left_in_order_without_holding_the_sender():
    async def run():
        reader, writer = await _pair()
        line = DelayLine.of(writer, 0.2)
        assert DelayLine.of(writer, 0.2) is line and DelayLine.existing(writer) is line
        left = []
        for chunk in (b"first ", b"second ", b"third"):
            left.append(time.monotonic())
            line.put(chunk)  # returns at once: the next may leave right away
        assert time.monotonic() - left[0] < 0.1
        got = await asyncio.wait_for(reader.readexactly(len(b"first second third")), 5)
        arrived = time.monotonic()
        assert got == b"first second third"
        assert arrived - left[-1] >= 0.2  # nothing before its delay
        await line.flushed()
        writer.close()

    asyncio.run(run())


def test_a_closed_stream_ends_the_line_quietly():
    async def run():
        reader, writer = await _pair()
        line = DelayLine.of(writer, 0.05)
        writer.close()
        line.put(b"lost")
        await asyncio.wait_for(line.flushed(), 5)  # the write failed: nothing waits forever

    asyncio.run(run())
