"""A DHT record kept alive: stored now and again every `announce_every_s` (the node's settings)
until stopped, since DHT records expire (`record_ttl_s`) unless refreshed."""

from __future__ import annotations

import asyncio

from swarm.transport.hivemind.net.node import SwarmNode


class Refresher:
    """Subclasses store their records in `refresh()`; it must not raise (a failed store is retried
    at the next round)."""

    def __init__(self, node: SwarmNode) -> None:
        self.node = node
        self.period, self.ttl = node.settings.dht.announce_every_s, node.settings.dht.record_ttl_s
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        raise NotImplementedError

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.period)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
