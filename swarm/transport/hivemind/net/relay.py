"""What a peer that can be dialed does for peers that cannot (behind NAT): tells them so, and
relays streams to them.

hivemind 1.1.12's p2pd has libp2p's circuit relay, but it cannot carry a stage's traffic: the
relay instance that answers reservations resets every relayed connection after 128 KiB and two
minutes (go-libp2p's defaults; the daemon's configurable relay service starts later and loses to
it), and hole punching waits for an observed public address that a small swarm may never
confirm (docs/swarm.md, "Peers behind NAT"). So hivepipe relays its own stage streams, bytes in
both directions, with no limit but the relay's links:

- `REACH` ("can I be dialed?"): the server opens a TCP connection to the address it sees the
  caller at, on each port the caller listens on (a public address, a forwarded port, a published
  container port answer there), and says which answered. It dials no other address, so nobody can
  point it at a third party.
- `RELAY`: a peer that cannot be dialed holds one stream open here (`hold`); a caller asks for a
  stream to one of a held peer's handlers (`target`, `protocol`: the stage protocol, the
  averager's...), and the relay opens one over the connection the held peer made, and pipes the
  bytes until either end closes. That stream (`RELAYED`) starts with the caller's peer id and the
  handler, which the held peer takes from its own relay only.

Every peer that can be dialed serves both (bootstrap, stage peers, the trainer); what it relayed
is in `Relay.carried` (bytes per held peer) and in its `peers.status` row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from hivemind.p2p import P2P, PeerID

from protocols import reach_pb2 as rpb
from protocols.errors import one_line
from swarm.transport.hivemind.net.streams import read_one

log = logging.getLogger(__name__)

REACH = "hivepipe.reach/1"
RELAY = "hivepipe.relay/1"
RELAYED = "hivepipe.relayed/1"  # the held peer's end: a stage stream, preceded by the caller's peer id
REQUEST_BYTES = 4096  # a reach or relay request: a few addresses, a peer id
DIAL_BACK_S = 3.0  # a TCP connect to the caller's address
MAX_HELD = 256  # peers held at once
MAX_CIRCUITS = 64  # relayed streams open at once per held peer
PIPE_CHUNK = 1 << 16


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, port) of /ip4/A/tcp/P or /ip6/A/tcp/P (anything after is ignored); None otherwise."""
    parts = str(maddr).split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        port = int(parts[4])
    except ValueError:
        return None
    return (parts[2], port) if 0 < port < 65536 else None


async def _connects(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, carried: Counter, key: str) -> None:
    """Copies until `reader` ends, counting the bytes under `carried[key]`; then closes `writer`."""
    try:
        while chunk := await reader.read(PIPE_CHUNK):
            writer.write(chunk)
            carried[key] += len(chunk)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Relay:
    """The REACH and RELAY handlers of one peer that can be dialed (see the module doc)."""

    def __init__(self, p2p: P2P, dial_back_s: float = DIAL_BACK_S) -> None:
        self.p2p, self.dial_back_s = p2p, dial_back_s
        self.held: dict[str, asyncio.Event] = {}  # held peer -> set when its hold stream ends
        self.circuits: Counter = Counter()  # open relayed streams per held peer
        self.carried: Counter = Counter()  # bytes relayed to and from each held peer
        self.refused: Counter = Counter()  # requests refused, by reason

    async def serve(self) -> None:
        await self.p2p.add_binary_stream_handler(REACH, self._reach)
        await self.p2p.add_binary_stream_handler(RELAY, self._relay)

    # ---- "can I be dialed?" -----------------------------------------------------------------

    async def _reach(self, info, reader, writer) -> None:
        try:
            request = await read_one(reader, rpb.ReachRequest, REQUEST_BYTES)
            seen = tcp_endpoint(str(info.addr))
            dialed = ""
            # the ports it listens on, at the address it is seen at: a public address, a forwarded
            # port, a published container port all answer there; nothing else is ever dialed
            ports = [e[1] for e in map(tcp_endpoint, list(request.addrs)[:16]) if e is not None]
            for port in dict.fromkeys(ports) if seen is not None else ():
                if await _connects(seen[0], port, self.dial_back_s):
                    dialed = f"/{'ip6' if ':' in seen[0] else 'ip4'}/{seen[0]}/tcp/{port}"
                    break
            observed = f"/ip4/{seen[0]}/tcp/{seen[1]}" if seen else ""
            await P2P.send_protobuf(rpb.ReachReply(dialed=dialed, observed=observed), writer)
        except Exception as e:  # a stranger's garbage: nothing to answer
            self.refused["reach: " + type(e).__name__] += 1
        finally:
            writer.close()

    # ---- relaying ---------------------------------------------------------------------------

    async def _relay(self, info, reader, writer) -> None:
        caller = info.peer_id.to_base58()
        try:
            request = await read_one(reader, rpb.RelayRequest, REQUEST_BYTES)
        except Exception as e:
            self.refused["relay: " + type(e).__name__] += 1
            writer.close()
            return
        if request.hold:
            await self._hold(caller, reader, writer)
        else:
            await self._connect(caller, request.target, request.protocol, reader, writer)

    async def _hold(self, peer: str, reader, writer) -> None:
        if peer not in self.held and len(self.held) >= MAX_HELD:
            await self._refuse(writer, f"this relay holds {MAX_HELD} peers already")
            return
        previous = self.held.pop(peer, None)
        if previous is not None:
            previous.set()  # a peer holds one stream: its newer one replaces the old
        ended = self.held[peer] = asyncio.Event()
        log.info("relay: holding %s (it cannot be dialed)", peer[-8:])
        try:
            await P2P.send_protobuf(rpb.RelayReply(), writer)
            waiting = asyncio.ensure_future(reader.read(1))  # the held peer sends nothing: it ends by closing
            stopped = asyncio.ensure_future(ended.wait())
            await asyncio.wait([waiting, stopped], return_when=asyncio.FIRST_COMPLETED)
            for task in (waiting, stopped):
                task.cancel()
        except (ConnectionError, OSError):
            pass
        finally:
            if self.held.get(peer) is ended:
                del self.held[peer]
                log.info("relay: %s no longer held", peer[-8:])
            writer.close()

    async def _connect(self, caller: str, target: str, protocol: str, reader, writer) -> None:
        if not protocol or protocol in (REACH, RELAY, RELAYED):
            await self._refuse(writer, f"no relaying to handler {protocol[:40]!r}")
            return
        if target not in self.held:
            await self._refuse(writer, f"peer {target[-8:]} is not held by this relay")
            return
        if self.circuits[target] >= MAX_CIRCUITS:
            await self._refuse(writer, f"{MAX_CIRCUITS} streams to {target[-8:]} are open already")
            return
        try:
            _, target_reader, target_writer = await self.p2p.call_binary_stream_handler(
                PeerID.from_base58(target), RELAYED
            )
            await P2P.send_protobuf(rpb.Relayed(caller=caller, protocol=protocol), target_writer)
        except Exception as e:
            await self._refuse(writer, f"could not reach {target[-8:]}: {one_line(e)}")
            return
        self.circuits[target] += 1
        try:
            await P2P.send_protobuf(rpb.RelayReply(), writer)
            carried = self.carried
            await asyncio.gather(
                _pipe(reader, target_writer, carried, target), _pipe(target_reader, writer, carried, target)
            )
        finally:
            self.circuits[target] -= 1
            target_writer.close()
            writer.close()

    async def _refuse(self, writer, why: str) -> None:
        self.refused["relay: " + why.split(":")[0][:40]] += 1
        with contextlib.suppress(Exception):
            await P2P.send_protobuf(rpb.RelayReply(error=why), writer)
        writer.close()
