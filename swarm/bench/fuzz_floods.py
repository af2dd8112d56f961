"""Floods of 2 MiB messages a stranger holds open and then completes (issue 58), which
`python -m swarm bench fuzz` and its tests send at a stage peer while a run trains: zero bytes
(once 2.3 s of a peer's Python each), random bytes, and 2 MiB of fields no message of the protocol
has. Each must be refused at about the cost of reading it, while the peer answers anyone's `info`
at once.

Every message is written on its own stream, all but its last byte, before the first is completed
(`Held`): the peer holds them all while their sender is not banned yet, and then finds each
complete, one after another.
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


def flood_messages(category: str, count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [FLOODS[category](rng) for _ in range(count)]


@dataclass
class Flooded:
    """What the peer did with each message completed (`outcomes`: (outcome, detail), as
    swarm.bench.fuzz.send reports them) and how long each status call made meanwhile took to be
    answered (`info_s`; None: it failed)."""

    outcomes: list[tuple[str, str]] = field(default_factory=list)
    info_s: list[float | None] = field(default_factory=list)


async def timed(probe: Callable[[], Awaitable]) -> float | None:
    """Seconds `probe()` took; None when it failed."""
    started = time.monotonic()
    try:
        await probe()
    except Exception:
        return None
    return time.monotonic() - started


class Held:
    """Messages held open at a peer, each on its own stream: all of each but its last byte written."""

    def __init__(self) -> None:
        self.waiting: list[tuple[PeerStream, bytes]] = []

    @classmethod
    async def open(cls, p2p, peer_id: str, messages: list[bytes]) -> Held:
        held = cls()
        try:
            for message in messages:
                stream = await PeerStream.open(p2p, peer_id)
                held.waiting.append((stream, message))
                stream.writer.write(framed(message)[:-1])
                await stream.writer.drain()
        except BaseException:
            held.close()
            raise
        return held

    async def complete(self, count: int, probe: Callable[[], Awaitable] | None, limit_s: float) -> Flooded:
        """Completes the next `count` messages one after another, each with `probe()` (a status
        call, say) made while the peer takes it."""
        result = Flooded()
        for _ in range(count):
            stream, message = self.waiting.pop(0)
            try:
                try:
                    stream.writer.write(message[-1:])
                    await stream.end()
                except (ConnectionError, OSError):  # turned away before it was read (banned): its reply waits
                    pass
                replied = answer(stream, limit_s)
                outcome, seconds = await asyncio.gather(replied, timed(probe) if probe else asyncio.sleep(0))
            finally:
                stream.close()
            result.outcomes.append(outcome)
            if probe is not None:
                result.info_s.append(seconds)
        return result

    def close(self) -> None:
        for stream, _ in self.waiting:
            stream.close()
        self.waiting.clear()
