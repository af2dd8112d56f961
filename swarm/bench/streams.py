"""`python -m swarm bench streams`: what a micro-batch exchange costs on a new hivemind stream
against one on a stream kept open (why `swarm.transport.hivemind.net.calls.StreamPool` exists).

Two P2P peers on loopback, each with its own p2pd daemon; the caller sends a request of
`payload_kb` and waits for a small reply, `exchanges` times, first opening a stream per exchange,
then on one stream. CPU seconds are those of this process and its children (the two daemons),
read from /proc schedstat (Linux): both ends' Python and both daemons (with the peers' daemon
threads, swarm.transport.hivemind.net.node.DAEMON_THREADS), i.e. what a pair of peers pays.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from hivemind.p2p import P2P

from swarm.netlab.counters import proc_stats
from swarm.transport.hivemind.net import loop
from swarm.transport.hivemind.net.node import start_daemon

HANDLER = "hivepipe-bench-streams"


@dataclass
class StreamCost:
    mode: str
    exchanges: int
    wall_ms: float  # per exchange
    cpu_ms: float  # per exchange, both peers' processes and daemons

    def as_dict(self) -> dict:
        return {"mode": self.mode, "exchanges": self.exchanges, "wall_ms": self.wall_ms, "cpu_ms": self.cpu_ms}


def tree_cpu_s() -> float:
    """CPU seconds of this process and its direct children so far, to the nanosecond: the sum of
    their threads' run times from /proc/<pid>/task/<tid>/schedstat (/proc/<pid>/stat counts 10 ms
    ticks, too coarse for a few short exchanges). Threads that ended are not counted."""
    me, nanoseconds = os.getpid(), 0
    for pid, _, fields in proc_stats():
        if pid != me and int(fields[1]) != me:
            continue
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    nanoseconds += int(f.read().split()[0])
        except OSError:  # the process or thread ended meanwhile
            continue
    return nanoseconds / 1e9


async def _serve(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Replies a few bytes to every request until the caller closes the stream."""
    try:
        while True:
            await P2P.receive_raw_data(reader)
            await P2P.send_raw_data(b"ok", writer)
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


async def _measure(exchanges: int, payload_kb: int) -> list[StreamCost]:
    if not os.path.isdir("/proc"):
        raise RuntimeError("bench streams reads CPU times from /proc (Linux only)")
    server = await start_daemon()
    client = await start_daemon(initial_peers=await server.get_visible_maddrs())
    try:
        await server.add_binary_stream_handler(HANDLER, _serve)
        payload = os.urandom(payload_kb * 1024)

        async def exchange(reader, writer) -> None:
            await P2P.send_raw_data(payload, writer)
            await P2P.receive_raw_data(reader)

        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, HANDLER)  # connects the peers
        await exchange(reader, writer)
        rows = []
        for mode in ("new stream each", "one stream"):
            wall, cpu = time.perf_counter(), tree_cpu_s()
            for _ in range(exchanges):
                if mode == "new stream each":
                    writer.close()
                    _, reader, writer = await client.call_binary_stream_handler(server.peer_id, HANDLER)
                await exchange(reader, writer)
            wall, cpu = time.perf_counter() - wall, tree_cpu_s() - cpu
            rows.append(StreamCost(mode, exchanges, 1000 * wall / exchanges, 1000 * cpu / exchanges))
        writer.close()
        return rows
    finally:
        await client.shutdown()
        await server.shutdown()


def run(exchanges: int = 300, payload_kb: int = 60) -> list[StreamCost]:
    return loop.run(_measure(exchanges, payload_kb))


def format_rows(rows: list[StreamCost], payload_kb: int) -> str:
    lines = [
        f"{payload_kb} KiB request, 2-byte reply, loopback, two p2pd daemons",
        f"{'stream':<16} {'exchanges':>9} {'wall ms':>8} {'CPU ms':>7}",
    ]
    lines += [f"{r.mode:<16} {r.exchanges:>9} {r.wall_ms:>8.2f} {r.cpu_ms:>7.2f}" for r in rows]
    return "\n".join(lines)
