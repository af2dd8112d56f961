"""A peer behind NAT's hold on its relay: one stream kept open at the relay, so that the relay can
open streams to it over the connection it made (swarm.transport.hivemind.net.relay). Opened again
when it drops; after a failure, at the next initial peer (each one that can be dialed relays)."""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID

from protocols import reach_pb2 as rpb
from protocols.errors import ProtocolError, one_line
from swarm.transport.hivemind.net.relay import RELAY, REQUEST_BYTES
from swarm.transport.hivemind.net.streams import read_one

log = logging.getLogger(__name__)

HOLD_RETRY_S = 2.0
ANSWER_S = 10.0  # for the relay's answer to a hold


class RelayHold:
    """Holds `me.relay` (a Reachability: its `relay` moves on to the next of `initial` after a
    failure) through `open_stream(peer_id, protocol)`, the daemon's own stream call."""

    def __init__(self, open_stream, me, initial: list[str], mine: str) -> None:
        self.open_stream, self.me, self.initial, self.mine = open_stream, me, initial, mine
        self.held = asyncio.Event()  # the relay holds it now
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._forever())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _forever(self) -> None:
        while True:
            try:
                await self._once(PeerID.from_base58(self.me.relay))
                log.warning("relay %s let go of this peer; holding again", self.me.relay[-8:])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("relay %s does not hold this peer: %s", self.me.relay[-8:], one_line(e))
                self._next_relay()
            await asyncio.sleep(HOLD_RETRY_S)

    async def _once(self, relay: PeerID) -> None:
        """Until the relay closes the hold stream (it sends nothing on it)."""
        _, reader, writer = await self.open_stream(relay, RELAY)
        try:
            await P2P.send_protobuf(rpb.RelayRequest(hold=True), writer)
            reply = await asyncio.wait_for(read_one(reader, rpb.RelayReply, REQUEST_BYTES), ANSWER_S)
            if reply.error:
                raise ProtocolError(reply.error)
            self.held.set()
            await reader.read(1)
        finally:
            self.held.clear()
            writer.close()

    def _next_relay(self) -> None:
        """The next initial peer (its record names the new relay from its next announcement)."""
        others = [p for p in self.initial if p != self.mine]
        if len(others) > 1 and self.me.relay in others:
            self.me.relay = others[(others.index(self.me.relay) + 1) % len(others)]
