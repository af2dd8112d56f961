"""An in-process link shaper for the send path: a token bucket for the rate, plus a one-way delay.

For machines without root (no namespaces, no tc) and for the delay where the kernel has no netem.
The sender calls it before writing each chunk of a payload to a libp2p stream:

    bucket = TokenBucket("20mbit", delay_s=0.01)       # or TokenBucket(20e6, burst_bytes=...)
    line = DelayLine.of(writer, bucket.delay_s)         # swarm.netlab.delayline: the one-way delay
    for chunk in chunks:
        await bucket.consume(len(chunk))                # waits until the link has room for it
        line.put(chunk)                                 # on the wire now, at the reader 10 ms later

or, for a stream that is an async iterator of chunks (what hivemind's streaming calls consume):

    async for chunk in shaped(chunks, bucket, size=lambda c: len(c.data)): ...

API
    TokenBucket(rate, burst_bytes=None, delay_s=0.0)       rate: bits/s or '20mbit' (rates.parse_rate)
        await .consume(nbytes) -> float   wait (s) so that the long-run rate is `rate`
        .stats() -> BucketStats           what it let through so far: bytes, calls (its own count)
        .set_rate(rate)                   a bandwidth change takes effect for the next bytes
    shaped(source, bucket, size=len) -> async iterator   rate + pipelined delay for a stream

Rate model: tokens are bytes, refilled at rate/8 per second up to `burst_bytes`; a consume takes
its bytes at once and may drive the balance negative, then sleeps until the debt is repaid. So a
chunk larger than the burst is fine, sleeping past the deadline costs nothing over the long run
(the next consume finds the tokens that accrued meanwhile), and concurrent senders sharing one
bucket (several streams over one link) get the link's rate together, in the order they asked.
The default burst is ~4 ms of traffic but at least 4 frames, like the tbf qdisc of
swarm.netlab.tc, so in-process and kernel shaping start the same way.

Delay model: a link delays each byte by `delay_s` without slowing the rate, and without holding
the sender: bytes go on a delay line (swarm.netlab.delayline) when they leave the bucket and reach
the stream `delay_s` later, in order, while the sender goes on; `shaped()` does the same for a
stream of chunks. (Sleeping the delay before each message instead would hold a sender that sends
one message at a time to a peer to one message per delay.)

Thread safety: the accounting is under a threading.Lock and no asyncio object is shared, so one
bucket may serve several event loops (one bucket per shaped link direction).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from swarm.netlab.tc import tbf_params
from swarm.rates import format_rate, parse_delay, parse_rate

T = TypeVar("T")


@dataclass(frozen=True)
class BucketStats:
    rate_bits: int
    delay_s: float
    bytes: int  # consumed so far
    calls: int


class TokenBucket:
    """A rate limiter in bytes with a debt model (see module docstring)."""

    def __init__(self, rate: str | int | float, burst_bytes: int | None = None, delay_s: str | float = 0.0) -> None:
        self._lock = threading.Lock()
        self.delay_s = parse_delay(delay_s)
        self._set(parse_rate(rate), burst_bytes)
        self._tokens = float(self.burst_bytes)
        self._stamp = time.monotonic()
        self._bytes = self._calls = 0

    def _set(self, rate_bits: int, burst_bytes: int | None) -> None:
        if burst_bytes is not None and burst_bytes < 1:
            raise ValueError(f"bad burst {burst_bytes!r}: must be at least 1 byte")
        self.rate_bits = rate_bits
        self.burst_bytes = int(burst_bytes) if burst_bytes is not None else tbf_params(rate_bits).burst_bytes
        self._bytes_per_s = rate_bits / 8

    def set_rate(self, rate: str | int | float, burst_bytes: int | None = None) -> None:
        """Changes the rate for bytes not yet booked (a simulated bandwidth change)."""
        with self._lock:
            self._refill(time.monotonic())
            self._set(parse_rate(rate), burst_bytes)
            self._tokens = min(self._tokens, self.burst_bytes)

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self._bytes_per_s)
        self._stamp = now

    def _reserve(self, nbytes: int) -> float:
        """Books `nbytes` on the link now; returns how long the caller must wait before sending them."""
        if nbytes < 0:
            raise ValueError(f"cannot send {nbytes} bytes")
        with self._lock:
            self._refill(time.monotonic())
            self._tokens -= nbytes
            self._bytes += nbytes
            self._calls += 1
            return max(0.0, -self._tokens / self._bytes_per_s)

    async def consume(self, nbytes: int) -> float:
        """Waits until `nbytes` may leave at the bucket's rate; returns the seconds waited."""
        wait = self._reserve(nbytes)
        if wait > 0:
            await asyncio.sleep(wait)
        return wait

    def stats(self) -> BucketStats:
        with self._lock:
            return BucketStats(self.rate_bits, self.delay_s, self._bytes, self._calls)

    def __repr__(self) -> str:
        return f"TokenBucket({format_rate(self.rate_bits)}, burst={self.burst_bytes}B, delay={self.delay_s}s)"


async def shaped(
    source: AsyncIterable[T] | AsyncIterator[T],
    bucket: TokenBucket | None,
    size: Callable[[T], int] = len,
    queue_items: int = 1024,
) -> AsyncIterator[T]:
    """Yields `source`'s items at the bucket's rate, each `bucket.delay_s` after it left the bucket.

    With no delay this is a plain loop (consume, then yield). With a delay, a helper task books the
    items on the bucket as fast as the rate allows and this generator releases each one at its
    departure time + delay, so the delay adds latency without cutting throughput. Closing the
    generator early cancels the helper.
    """
    if bucket is None:
        async for item in source:
            yield item
        return
    if bucket.delay_s <= 0:
        async for item in source:
            await bucket.consume(size(item))
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue(queue_items)

    async def pump() -> None:
        try:
            async for item in source:
                await bucket.consume(size(item))
                await queue.put((time.monotonic() + bucket.delay_s, "item", item))
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put((0.0, "error", e))
        else:
            await queue.put((0.0, "end", None))

    task = asyncio.create_task(pump())
    try:
        while True:
            due, kind, item = await queue.get()
            if kind == "end":
                break
            if kind == "error":
                raise item
            pause = due - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            yield item
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
