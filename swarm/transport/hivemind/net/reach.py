"""How this peer is reached, and how it reaches the others: directly, or through a relay when one
of the two cannot be dialed (behind NAT). The other end, on peers that can be dialed, is
swarm.transport.hivemind.net.relay.

At start a peer asks its initial peers whether they can dial it back (`check`); a volunteer passes
no flag for it. A peer they cannot dial:
- runs its DHT node as a client (it answers no DHT requests: nobody could send them), as Petals
  does for peers reachable only through a relay;
- holds a stream open at the first initial peer that answered (its relay;
  swarm.transport.hivemind.net.hold), and names that relay in its stage record;
- is called through its relay by peers that have no connection to it (a connection it opened
  itself, to a neighbour it calls, carries that neighbour's calls back directly).

`Reach` takes over its node's P2P for that: every stream the node opens (stage calls, the
replicas' all-reduce, state downloads) goes directly or through the callee's relay, and every
handler the node registers is also served on streams its relay brings, as the real caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocols import reach_pb2 as rpb
from protocols import stage_pb2 as pb
from protocols.errors import ProtocolError, one_line
from swarm.transport.hivemind.net.hold import RelayHold
from swarm.transport.hivemind.net.relay import REACH, RELAY, RELAYED, REQUEST_BYTES
from swarm.transport.hivemind.net.streams import read_one

log = logging.getLogger(__name__)

PUBLIC, BEHIND_NAT, UNKNOWN = "public", "behind NAT", "unknown"
CHECK_TIMEOUT_S = 10.0


@dataclass
class Reachability:
    """What the initial peers found: `state` (PUBLIC: one dialed it back; BEHIND_NAT: none could;
    UNKNOWN: none answered), the address it was dialed at or is seen at, and its relay."""

    state: str = UNKNOWN
    dialed: str = ""
    observed: str = ""
    relay: str = ""  # the peer id holding it (BEHIND_NAT)

    def describe(self) -> str:
        if self.state == PUBLIC:
            return f"reachable at {self.dialed}"
        if self.state == BEHIND_NAT:
            seen = f", seen as {self.observed}" if self.observed else ""
            return f"behind NAT (nobody can dial it{seen}): reached through relay {self.relay[-8:]}"
        return "reachability not checked (no initial peer asked, or none could tell)"


def peer_of(maddr: str) -> str | None:
    """The peer id at the end of a full multiaddr (.../p2p/<id>)."""
    parts = str(maddr).rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs") else None


def listen_addrs(maddrs) -> list[str]:
    """Our addresses, without the /p2p/ part (the asked peer dials their ports at the address it
    sees us at, never their hosts: a private host says nothing to it)."""
    return list(dict.fromkeys(str(maddr).split("/p2p/")[0] for maddr in maddrs))


async def ask(p2p: P2P, peer: str, addrs: list[str], timeout: float) -> rpb.ReachReply:
    async def run() -> rpb.ReachReply:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), REACH)
        try:
            await P2P.send_protobuf(rpb.ReachRequest(addrs=addrs), writer)
            return await read_one(reader, rpb.ReachReply, REQUEST_BYTES)
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout)


async def check(p2p: P2P, initial_peers, timeout: float = CHECK_TIMEOUT_S) -> Reachability:
    """Asks the initial peers, in order, whether they can dial this peer back; the first answer counts."""
    addrs = listen_addrs(await p2p.get_visible_maddrs(latest=True))
    for maddr in initial_peers:
        peer = peer_of(maddr)
        if peer is None or peer == p2p.peer_id.to_base58():
            continue
        try:
            reply = await ask(p2p, peer, addrs, timeout)
        except Exception as e:  # an older peer without the handler, or gone: ask the next
            log.debug("reachability check via %s failed: %s", peer[-8:], one_line(e))
            continue
        if reply.dialed:
            return Reachability(PUBLIC, dialed=reply.dialed, observed=reply.observed)
        return Reachability(BEHIND_NAT, observed=reply.observed, relay=peer)
    return Reachability()


class Reach:
    """This peer's reachability, its hold on its relay (if behind NAT), the others' relays (from
    their records), and its node's streams, opened and served directly or through a relay."""

    OWN = (REACH, RELAY, RELAYED)  # the reach protocols themselves: not counted, never relayed

    def __init__(self, p2p: P2P, me: Reachability, initial_peers=()) -> None:
        self.p2p, self.me = p2p, me
        self.initial = [p for p in map(peer_of, initial_peers) if p]  # relays too, when they can be dialed
        self.relays: dict[str, str] = {}  # peer -> its relay, as its record says
        self.opened: Counter = Counter()  # streams this peer opened: "direct", "relayed"
        self.arrived: Counter = Counter()  # streams that reached it: "direct", "relayed", "refused"
        self.handlers: dict[str, object] = {}  # handler name -> what serves it
        # the daemon's own calls; the node's P2P gets ours in their place
        self._open, self._add = p2p.call_binary_stream_handler, p2p.add_binary_stream_handler
        p2p.call_binary_stream_handler, p2p.add_binary_stream_handler = self.call, self.add_handler
        self.holding: RelayHold | None = None  # behind NAT: its hold on its relay

    @property
    def behind_nat(self) -> bool:
        return self.me.state == BEHIND_NAT

    def learn(self, peer: str, relay: str) -> None:
        if relay:
            self.relays[peer] = relay
        else:
            self.relays.pop(peer, None)

    # ---- being held -----------------------------------------------------------------------------

    async def serve_relayed(self) -> None:
        """Behind NAT: what its relay brings is served as its handlers' streams, and the relay
        holds it from now on."""
        await self._add(RELAYED, self._relayed)
        self.holding = RelayHold(self._open, self.me, self.initial, self.p2p.peer_id.to_base58())
        self.holding.start()

    def close(self) -> None:
        if self.holding is not None:
            self.holding.close()

    def summary(self, relay=None) -> str:
        """One line: how this peer was reached and reached the others (and what it relayed)."""

        def counts(counter: Counter) -> str:
            return ", ".join(f"{n} {how}" for how, n in sorted(counter.items()) if n) or "none"

        line = f"{self.me.state}; streams in: {counts(self.arrived)}; streams out: {counts(self.opened)}"
        if relay is not None and relay.carried:
            line += (
                f"; relayed {sum(relay.carried.values()) / 2**20:.1f} MiB for {len(relay.carried)} peer(s) behind NAT"
            )
        return line

    def status(self, relay=None) -> pb.Reach:
        """For peers.status: its reachability, its streams by how they went, and what it relays
        (`relay`: its swarm.transport.hivemind.net.relay.Relay, when it can be dialed)."""
        me = self.me
        reply = pb.Reach(state=me.state, address=me.dialed or me.observed, relay=me.relay)
        reply.arrived.update(self.arrived)
        reply.opened.update(self.opened)
        if relay is not None:
            reply.holding, reply.relayed_bytes = len(relay.held), sum(relay.carried.values())
        return reply

    # ---- serving --------------------------------------------------------------------------------

    async def add_handler(self, name: str, handler, balanced: bool = False) -> None:
        """The node's P2P.add_binary_stream_handler: `handler` also serves its relayed streams."""
        if name in self.OWN:
            await self._add(name, handler, balanced)
            return
        self.handlers[name] = handler

        async def direct(info, reader, writer) -> None:
            self.arrived["direct"] += 1
            await handler(info, reader, writer)

        await self._add(name, direct, balanced)

    async def caller(self, info, reader) -> rpb.Relayed | None:
        """Who called, and which handler, on a RELAYED stream: as its relay says; None (refused) on
        a stream from anyone but its own relay, or one that does not begin with a caller."""
        if not self.behind_nat or info.peer_id.to_base58() != self.me.relay:
            self.arrived["refused"] += 1
            return None
        try:
            relayed = await asyncio.wait_for(read_one(reader, rpb.Relayed, REQUEST_BYTES), CHECK_TIMEOUT_S)
            PeerID.from_base58(relayed.caller)
        except Exception:
            self.arrived["refused"] += 1
            return None
        return relayed

    async def _relayed(self, info, reader, writer) -> None:
        relayed = await self.caller(info, reader)
        handler = self.handlers.get(relayed.protocol) if relayed is not None else None
        if handler is None:
            if relayed is not None:
                self.arrived["refused"] += 1
            writer.close()
            return
        self.arrived["relayed"] += 1
        caller = StreamInfo(PeerID.from_base58(relayed.caller), info.addr, relayed.protocol)
        await handler(caller, reader, writer)

    # ---- reaching others ------------------------------------------------------------------------

    async def _connected(self, peer: str) -> bool:
        with contextlib.suppress(Exception):
            return any(info.peer_id.to_base58() == peer for info in await self.p2p.list_peers())
        return False

    async def call(self, peer_id: PeerID, protocol: str):
        """The node's P2P.call_binary_stream_handler: directly when the peer can be dialed or a
        connection to it is open, else through its relay."""
        peer = peer_id.to_base58()
        relay = self.relays.get(peer)
        if protocol in self.OWN:
            return await self._open(peer_id, protocol)
        if relay and relay != self.p2p.peer_id.to_base58() and not await self._connected(peer):
            return await self._relayed_call(peer_id, relay, protocol)
        try:
            opened = await self._open(peer_id, protocol)
        except Exception:
            # no record named its relay (a replica, a joiner's source): one of the relays we know
            # may hold it; each refuses at once a peer it does not hold
            for relay in self.known_relays(peer):
                with contextlib.suppress(Exception):
                    return await self._relayed_call(peer_id, relay, protocol)
            raise
        self.opened["direct"] += 1
        return opened

    def known_relays(self, peer: str) -> list[str]:
        """Relays to try for `peer`: ours, then those of other peers' records (not itself, not us)."""
        candidates = [self.me.relay, *self.relays.values(), *self.initial]
        mine = self.p2p.peer_id.to_base58()
        return [r for r in dict.fromkeys(candidates) if r and r not in (peer, mine)]

    async def _relayed_call(self, peer_id: PeerID, relay: str, protocol: str):
        reader, writer = await self.through(relay, peer_id.to_base58(), protocol)
        self.relays.setdefault(peer_id.to_base58(), relay)
        self.opened["relayed"] += 1
        return StreamInfo(peer_id, None, protocol), reader, writer

    async def through(self, relay: str, peer: str, protocol: str):
        """(reader, writer) of a stream to `peer`'s `protocol` handler through `relay`."""
        _, reader, writer = await self._open(PeerID.from_base58(relay), RELAY)
        try:
            await P2P.send_protobuf(rpb.RelayRequest(target=peer, protocol=protocol), writer)
            reply = await read_one(reader, rpb.RelayReply, REQUEST_BYTES)
        except BaseException:
            writer.close()
            raise
        if reply.error:
            writer.close()
            raise ProtocolError(f"relay {relay[-8:]}: {reply.error}")
        return reader, writer
