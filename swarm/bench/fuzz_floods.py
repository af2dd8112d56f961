"""Floods of 2 MiB messages a stranger holds open and then completes (issue 58), which
`python -m swarm bench fuzz` and its tests send at a stage peer while a run trains: zero bytes
(once 2.3 s of a peer's Python each), random bytes, and 2 MiB of fields no message of the protocol
has. Each must be refused at about the cost of reading it, while the peer answers anyone's `info`
at once.

Every message is written on its own stream, all but its last byte, before the first is completed:
the peer holds them all while the stranger is not banned yet, and then finds each complete.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from swarm.bench.fuzz import answer
from swarm.bench.fuzz_cases import framed
from swarm.transport.hivemind.net.streams import MAX_MESSAGE_BYTES, PeerStream

FLOODS = {
    "zero-filled 2 MiB, held": lambda rng: bytes(MAX_MESSAGE_BYTES),
    "random 2 MiB, held": lambda rng: rng.randbytes(MAX_MESSAGE_BYTES),
    "2 MiB of empty fields, held": lambda rng: b"\x08\x00" * (MAX_MESSAGE_BYTES // 2),  # field 1, 0, again and again
}


@dataclass
class Flooded:
    """What the peer did with each message (`outcomes`: (outcome, detail) as fuzz.send reports
    them) and how long each status call made meanwhile took to answer (`info_s`; None: it failed)."""

    outcomes: list[tuple[str, str]] = field(default_factory=list)
    info_s: list[float | None] = field(default_factory=list)

    @property
    def slowest_info_s(self) -> float:
        return max((s if s is not None else float("inf") for s in self.info_s), default=0.0)


async def timed(probe: Callable[[], Awaitable]) -> float | None:
    """Seconds `probe()` took; None when it failed."""
    started = time.monotonic()
    try:
        await probe()
    except Exception:
        return None
    return time.monotonic() - started


async def flood(
    p2p, peer_id: str, messages: list[bytes], probe: Callable[[], Awaitable] | None, limit_s: float
) -> Flooded:
    """Holds `messages` open at `peer_id`, each on its own stream, then completes them one after
    another, each with `probe()` (a status call, say) made while the peer takes it."""
    streams = []
    try:
        for message in messages:
            stream = await PeerStream.open(p2p, peer_id)
            streams.append(stream)
            stream.writer.write(framed(message)[:-1])
            await stream.writer.drain()
        result = Flooded()
        for stream, message in zip(streams, messages, strict=True):
            stream.writer.write(message[-1:])
            await stream.end()
            if probe is None:
                result.outcomes.append(await answer(stream, limit_s))
                continue
            outcome, seconds = await asyncio.gather(answer(stream, limit_s), timed(probe))
            result.outcomes.append(outcome)
            result.info_s.append(seconds)
        return result
    finally:
        for stream in streams:
            stream.close()


def flood_messages(category: str, count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [FLOODS[category](rng) for _ in range(count)]
