"""How many stores of one key a pair of hivemind DHT nodes takes a second on this machine: the hot
key of a large swarm is the run listing, one subkey per peer re-stored every `announce_every_s`
(swarm.bench.scale_dht). The scale model's `dht_stores_per_s` is compared against this.

    python -m swarm.bench.dht_stores [STORES] [CONCURRENCY ...]

Each store is a signed-record-sized value (swarm.bench.scale_dht.RECORD_BYTES) under a new subkey
of one key, from the second node (it finds the key's nearest nodes, the first and itself, and
stores on both), `concurrency` at a time. No signatures are checked here (hivepipe's nodes check
an RSA signature on each), so the real rate is lower.
"""

from __future__ import annotations

import asyncio
import sys
import time

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.bench.scale_dht import RECORD_BYTES


async def stores_per_s(stores: int, concurrencies: list[int]) -> list[tuple[int, float]]:
    first = await DHTNode.create()
    second = await DHTNode.create(initial_peers=await first.protocol.p2p.get_visible_maddrs())
    value = b"x" * RECORD_BYTES
    rates = []
    try:
        for concurrency in concurrencies:
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int, gate: asyncio.Semaphore = gate, concurrency: int = concurrency) -> bool:
                async with gate:
                    return await second.store("listing", value, get_dht_time() + 60, subkey=f"{concurrency}.{i}")

            started = time.perf_counter()
            stored = await asyncio.gather(*(one(i) for i in range(stores)))
            if not all(stored):
                raise RuntimeError(f"{stores - sum(stored)} of {stores} stores failed")
            rates.append((concurrency, stores / (time.perf_counter() - started)))
    finally:
        await second.shutdown()
        await first.shutdown()
    return rates


def main(argv: list[str]) -> int:
    stores = int(argv[0]) if argv else 400
    concurrencies = [int(c) for c in argv[1:]] or [1, 16, 64]
    for concurrency, rate in asyncio.run(stores_per_s(stores, concurrencies)):
        print(f"{stores} stores of one key, {concurrency} at a time: {rate:.0f} stores/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
