"""What a stranger's oversized unary requests cost a peer's DHT (hivemind 1.1.12's unary handlers,
which every hivepipe peer serves on its p2p daemon): `python -m swarm.bench.unary_flood`.

A peer (hivemind P2P + DHT node, as a SwarmNode has) runs in a process of its own; a stranger
lifts its own client's message limit and calls the peer's `rpc_find` with 1, 3, 4, 8, 64 and 256
MiB, then 32 calls of 3 MiB at once. Printed: what the stranger heard, and the peer's and its
daemon's resident memory after each.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

SIZES_MIB = (1, 3, 4, 8, 64, 256)
FLOOD = 32  # calls of 3 MiB at once
HANDLER = "DHTProtocol.rpc_find"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peer(addresses, stop) -> None:
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    async def run() -> None:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        node = await DHTNode.create(p2p=p2p)
        addresses.put(([str(m) for m in await p2p.get_visible_maddrs()], p2p._child.pid, str(p2p.peer_id)))
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await node.shutdown()
        await p2p.shutdown()

    asyncio.run(run())


async def _stranger(maddrs: list[str], peer: str):
    from hivemind.p2p import P2P, PeerID

    stranger = await P2P.create(initial_peers=maddrs)
    stranger._client.control.persistent_conn_max_msg_size = 1 << 31  # past its own client's check
    return stranger, PeerID.from_base58(peer)


def main() -> None:
    mp.set_start_method("spawn", force=True)
    addresses, stop = mp.Queue(), mp.Event()
    process = mp.Process(target=_peer, args=(addresses, stop), daemon=True)
    process.start()
    maddrs, daemon, peer = addresses.get(timeout=120)
    loop = asyncio.new_event_loop()
    stranger, peer_id = loop.run_until_complete(_stranger(maddrs, peer))

    def memory() -> str:
        return f"peer RSS {_rss_mib(process.pid):.0f} MiB, its p2pd {_rss_mib(daemon):.0f} MiB"

    def send(data: bytes):
        return stranger._client.call_unary_handler(peer_id, HANDLER, data)

    try:
        time.sleep(1)
        print(f"idle: {memory()}")
        for size in SIZES_MIB:
            started = time.perf_counter()
            try:
                loop.run_until_complete(asyncio.wait_for(send(bytes(size << 20)), 30))
                heard = "answered"
            except Exception as e:  # noqa: BLE001  what the stranger hears is the figure
                heard = f"{type(e).__name__}: {str(e)[:80]}"
            time.sleep(1)
            print(f"{size} MiB: {heard} after {time.perf_counter() - started:.1f}s; {memory()}")

        async def flood():
            calls = [asyncio.wait_for(send(os.urandom(3 << 20)), 60) for _ in range(FLOOD)]
            return await asyncio.gather(*calls, return_exceptions=True)

        started = time.perf_counter()
        results = loop.run_until_complete(flood())
        errors = sum(isinstance(r, BaseException) for r in results)
        print(f"{FLOOD} x 3 MiB at once: {errors} failed after {time.perf_counter() - started:.1f}s; {memory()}")
    finally:
        loop.run_until_complete(stranger.shutdown())
        stop.set()
        process.join(30)


if __name__ == "__main__":
    main()
