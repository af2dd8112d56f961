"""Payload throughput between two hivemind P2P peers: what a stage link really carries.

A probe server is a hivemind P2P instance with one binary stream handler; a client opens a stream
and either sends N bytes and waits for the server's acknowledgement ("up": client -> server), or
asks for N bytes and reads them ("down": server -> client). Mbit/s are payload bits over the time
from the first byte written to the last byte acknowledged/read, after a small warm-up transfer
that opens the connection (so no handshake is timed). libp2p, TLS/noise and TCP/IP overheads are
inside the measurement, so the payload rate over a tbf link stays somewhat below the link's rate.

In-process (both peers here, e.g. to check the in-process shaper):
    results = await probe_in_process(4_000_000, bucket=TokenBucket("20mbit"), directions=("up",))

Across namespaces, swarm.lab.probe_namespaces.probe_netlab runs this module's command line in
each process's namespace:
    python -m swarm.lab.probe serve --host /ip4/10.77.0.3/tcp/0 [--rate 20mbit --delay 10ms]
        prints `PROBE-MADDR <multiaddr>` lines, serves until stdin closes or SIGINT/SIGTERM
    python -m swarm.lab.probe client --peer MADDR [--peer MADDR ...] [--peers_from_stdin]
        --bytes N [--direction up down] [--host MADDR] [--rate R --delay D]
        prints one JSON object per (peer, direction): ProbeResult.to_dict()
--rate/--delay put a TokenBucket on that side's send path (in-process shaping).

API
    PROTOCOL = "hivepipe.netlab.probe"
    ProbeResult(peer, direction, nbytes, seconds)  .mbit_per_s  .to_dict()
    await start_server(host_maddrs=("/ip4/127.0.0.1/tcp/0",), bucket=None) -> ProbeServer
        .p2p  .maddrs (list[str])  await .close()
    await measure(p2p, peer_id, nbytes, direction="up", bucket=None, chunk_bytes=65536) -> ProbeResult
    await probe_peers(maddrs, nbytes, directions=("up","down"), host_maddrs=..., bucket=None)
    await probe_in_process(nbytes, bucket=None, directions=("up","down"), server_bucket=None)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.netlab.shaper import TokenBucket
from swarm.transport.hivemind.net import loop as loops
from swarm.transport.hivemind.net.node import start_daemon

PROTOCOL = "hivepipe.netlab.probe"
CHUNK_BYTES = 65536
WARMUP_BYTES = 65536
_HEADER = struct.Struct("!cQ")  # b"U" (client sends) or b"D" (server sends), byte count
_ACK = struct.Struct("!Qd")  # bytes received, server-side seconds from first to last byte
ADDRESS_MARK = "PROBE-MADDR "  # starts each line of a server's addresses on its stdout


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    direction: str  # "up": client -> server, "down": server -> client
    nbytes: int
    seconds: float

    @property
    def mbit_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "mbit_per_s": self.mbit_per_s}

    @classmethod
    def from_dict(cls, data: dict) -> ProbeResult:
        return cls(data["peer"], data["direction"], int(data["nbytes"]), float(data["seconds"]))


def _p2p_options(host_maddrs: Sequence[str]) -> dict:
    return {
        "host_maddrs": list(host_maddrs),
        "use_relay": False,
        "auto_nat": False,
        "nat_port_map": False,
        "startup_timeout": 60,
    }


async def _send(writer: asyncio.StreamWriter, nbytes: int, bucket: TokenBucket | None, chunk_bytes: int) -> None:
    block = bytes(chunk_bytes)
    left = nbytes
    while left > 0:
        n = min(left, chunk_bytes)
        if bucket is not None:
            await bucket.consume(n)
        writer.write(block[:n] if n < chunk_bytes else block)
        await writer.drain()
        left -= n


async def _receive(reader: asyncio.StreamReader, nbytes: int) -> float:
    """Reads exactly `nbytes`; returns the seconds from the first byte to the last."""
    first = None
    left = nbytes
    while left > 0:
        data = await reader.read(min(left, 1 << 20))
        if not data:
            raise ConnectionError(f"the stream ended {left} bytes short of {nbytes}")
        if first is None:
            first = time.monotonic()
        left -= len(data)
    return time.monotonic() - first if first is not None else 0.0


class ProbeServer:
    def __init__(self, p2p, maddrs: list[str]) -> None:
        self.p2p, self.maddrs = p2p, maddrs

    async def close(self) -> None:
        await self.p2p.shutdown()


async def start_server(
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",), bucket: TokenBucket | None = None
) -> ProbeServer:
    """A P2P instance serving PROTOCOL; `bucket` shapes what it sends ("down")."""
    p2p = await start_daemon(**_p2p_options(host_maddrs))

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    kind, nbytes = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                except asyncio.IncompleteReadError:
                    return
                if kind == b"U":
                    spent = await _receive(reader, nbytes)
                    writer.write(_ACK.pack(nbytes, spent))
                    await writer.drain()
                elif kind == b"D":
                    await _send(writer, nbytes, bucket, CHUNK_BYTES)
                else:
                    return
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(PROTOCOL, handle)
    return ProbeServer(p2p, [str(m) for m in await p2p.get_visible_maddrs()])


async def measure(
    p2p, peer_id, nbytes: int, direction: str = "up", bucket: TokenBucket | None = None, chunk_bytes: int = CHUNK_BYTES
) -> ProbeResult:
    """One timed transfer of `nbytes` on a fresh stream (after a warm-up transfer on it)."""
    if direction not in ("up", "down"):
        raise ValueError(f"bad direction {direction!r}: up or down")
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROTOCOL)
    try:
        for size, timed in ((WARMUP_BYTES, False), (nbytes, True)):
            start = time.monotonic()
            if direction == "up":
                writer.write(_HEADER.pack(b"U", size))
                await _send(writer, size, bucket if timed else None, chunk_bytes)
                received, _ = _ACK.unpack(await reader.readexactly(_ACK.size))
                if received != size:
                    raise ConnectionError(f"the probe server acknowledged {received} of {size} bytes")
            else:
                writer.write(_HEADER.pack(b"D", size))
                await writer.drain()
                await _receive(reader, size)
            seconds = time.monotonic() - start
    finally:
        writer.close()
    return ProbeResult(str(peer_id), direction, nbytes, seconds)


async def _connect(p2p, maddr: str):
    peer_id = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    # P2P has no public "dial this address"; hivemind itself uses the daemon client's connect
    await p2p._client.connect(peer_id, [Multiaddr(maddr.rsplit("/p2p/", 1)[0])])
    return peer_id


async def probe_peers(
    maddrs: Sequence[str],
    nbytes: int,
    directions: Sequence[str] = ("up", "down"),
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    bucket: TokenBucket | None = None,
    p2p=None,
) -> list[ProbeResult]:
    """Measures each of `maddrs` (full multiaddrs with /p2p/ID) in turn, every direction."""
    own = p2p is None
    p2p = p2p or await start_daemon(**_p2p_options(host_maddrs))
    try:
        results = []
        for maddr in maddrs:
            peer_id = await _connect(p2p, maddr)
            for direction in directions:
                result = await measure(p2p, peer_id, nbytes, direction, bucket)
                results.append(ProbeResult(maddr, direction, result.nbytes, result.seconds))
        return results
    finally:
        if own:
            await p2p.shutdown()


async def probe_in_process(
    nbytes: int,
    bucket: TokenBucket | None = None,
    directions: Sequence[str] = ("up", "down"),
    server_bucket: TokenBucket | None = None,
) -> list[ProbeResult]:
    """Two P2P instances on loopback in this process; `bucket` shapes the client's sends, `server_bucket` the server's."""
    server = await start_server(bucket=server_bucket)
    try:
        return await probe_peers(server.maddrs[:1], nbytes, directions, bucket=bucket)
    finally:
        await server.close()


# ---------------------------------------------------------------------------------- command line


def _bucket(args: argparse.Namespace) -> TokenBucket | None:
    return TokenBucket(args.rate, delay_s=args.delay or 0.0) if args.rate else None


async def _serve(args: argparse.Namespace) -> int:
    server = await start_server(args.host, _bucket(args))
    try:
        for maddr in server.maddrs:
            print(ADDRESS_MARK + maddr, flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def watch_stdin() -> None:  # the parent closing our stdin (or dying) ends us
            sys.stdin.read()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=watch_stdin, daemon=True).start()
        await stop.wait()
    finally:
        await server.close()
    return 0


async def _client(args: argparse.Namespace) -> int:
    p2p = await start_daemon(**_p2p_options(args.host))  # started before the peers are known
    try:
        peers = list(args.peer)
        if args.peers_from_stdin:
            peers += await _stdin_lines()
        if not peers:
            print("error: no peer to probe (--peer or --peers_from_stdin)", file=sys.stderr)
            return 2
        for result in await probe_peers(peers, args.bytes, args.direction, bucket=_bucket(args), p2p=p2p):
            print(json.dumps(result.to_dict()), flush=True)
    finally:
        await p2p.shutdown()
    return 0


async def _stdin_lines() -> list[str]:
    """Lines from stdin up to an empty line or EOF, read on a daemon thread (never blocks exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[str]] = loop.create_future()

    def read() -> None:
        lines = []
        for line in sys.stdin:
            if not line.strip():
                break
            lines.append(line.strip())
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(lines))

    threading.Thread(target=read, daemon=True).start()
    return await done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.lab.probe", description="payload throughput between two hivemind P2P peers"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the probe protocol; prints PROBE-MADDR lines")
    client = sub.add_parser("client", help="measure one or more probe servers; prints JSON lines")
    for p in (serve, client):
        p.add_argument("--host", nargs="+", default=["/ip4/127.0.0.1/tcp/0"], help="multiaddrs to listen on")
        p.add_argument("--rate", default=None, help="shape this side's sends in-process, e.g. 20mbit")
        p.add_argument("--delay", default=None, help="with --rate: one-way delay, e.g. 10ms")
    client.add_argument("--peer", action="append", default=[], help="a probe server's full multiaddr (.../p2p/ID)")
    client.add_argument(
        "--peers_from_stdin",
        action="store_true",
        help="also read peer multiaddrs from stdin, one a line, until an empty line",
    )
    client.add_argument("--bytes", type=int, default=4_000_000, help="payload bytes per timed transfer")
    client.add_argument("--direction", nargs="+", choices=("up", "down"), default=["up", "down"])
    args = parser.parse_args(argv)
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    try:
        return loops.run(_serve(args) if args.command == "serve" else _client(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, ConnectionError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
