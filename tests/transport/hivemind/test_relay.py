"""The relay and the reachability check between real hivemind nodes on loopback
(swarm.transport.hivemind.net.relay and .reach): what they do for a peer behind NAT, and what
they refuse a stranger."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from protocols import reach_pb2 as rpb
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.reach import BEHIND_NAT, PUBLIC, Reachability, ask
from swarm.transport.hivemind.net.relay import REACH, RELAY, RELAYED, REQUEST_BYTES
from swarm.transport.hivemind.net.streams import read_one

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

WHO = "test.who/1"  # a handler of the held peer's, reached directly or through the relay


async def _relay_request(node: SwarmNode, relay: SwarmNode, request: rpb.RelayRequest) -> rpb.RelayReply:
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(relay.peer_id), RELAY)
    await P2P.send_protobuf(request, writer)
    try:
        return await read_one(reader, rpb.RelayReply, REQUEST_BYTES)
    finally:
        writer.close()


async def _swarm_with_a_peer_behind_nat():
    """A relay (the bootstrap), a peer held by it as if behind NAT, and a third peer. The held
    peer serves a handler that records who each of its streams is from."""
    relay = await SwarmNode.create(NodeOptions())
    initial = await relay.maddrs()
    held = await SwarmNode.create(NodeOptions(initial_peers=initial))
    other = await SwarmNode.create(NodeOptions(initial_peers=initial))
    assert relay.reach.me.state != BEHIND_NAT and held.reach.me.state == PUBLIC  # loopback dials back
    held.reach.me = Reachability(BEHIND_NAT, relay=relay.peer_id)  # what a NATed peer's check finds
    await held.reach.serve_relayed()
    await asyncio.wait_for(held.reach.holding.held.wait(), 30)
    callers: asyncio.Queue = asyncio.Queue()

    async def who(info, reader, writer):
        await callers.put(info.peer_id.to_base58())
        writer.close()

    await held.p2p.add_binary_stream_handler(WHO, who)
    return relay, held, other, callers


def test_a_relayed_stream_names_its_caller_and_only_the_relay_may_name_one():
    async def run():
        relay, held, other, callers = await _swarm_with_a_peer_behind_nat()
        try:
            # through the relay: the held peer's handler sees the real caller
            _, writer = await other.reach.through(relay.peer_id, held.peer_id, WHO)
            assert await asyncio.wait_for(callers.get(), 30) == other.peer_id
            writer.close()
            # straight to the held peer's RELAYED handler, claiming to be someone: refused
            _, reader, writer = await other.p2p.call_binary_stream_handler(PeerID.from_base58(held.peer_id), RELAYED)
            await P2P.send_protobuf(rpb.Relayed(caller=relay.peer_id, protocol=WHO), writer)
            assert await asyncio.wait_for(reader.read(), 30) == b""
            assert held.reach.arrived["refused"] == 1 and held.reach.arrived["relayed"] >= 1
            assert callers.empty()
            # the relay relays only to peers it holds, and only to their handlers
            reply = await _relay_request(other, relay, rpb.RelayRequest(target=other.peer_id, protocol=WHO))
            assert reply.error == f"peer {other.peer_id[-8:]} is not held by this relay"
            reply = await _relay_request(other, relay, rpb.RelayRequest(target=held.peer_id, protocol=RELAY))
            assert reply.error == "no relaying to handler 'hivepipe.relay/1'"
            assert relay.relay.held.keys() == {held.peer_id}
        finally:
            for node in (other, held, relay):
                await node.shutdown()

    asyncio.run(run())


def test_the_reachability_check_dials_back_only_the_address_it_sees_the_caller_at():
    async def run():
        relay = await SwarmNode.create(NodeOptions())
        caller = await SwarmNode.create(NodeOptions(initial_peers=await relay.maddrs()))
        try:
            elsewhere = ["/ip4/10.255.255.1/tcp/80", "/ip4/127.0.0.1/tcp/x", "garbage"]
            reply = await ask(caller.p2p, relay.peer_id, elsewhere, 30)
            assert reply.dialed == "" and reply.observed.startswith("/ip4/127.0.0.1/tcp/")
            ours = [a.split("/p2p/")[0] for a in await caller.maddrs()]
            assert (await ask(caller.p2p, relay.peer_id, ours, 30)).dialed in ours
            assert caller.reach.me.state == PUBLIC and caller.reach.me.dialed in ours
        finally:
            await caller.shutdown()
            await relay.shutdown()

    asyncio.run(run())


def test_a_strangers_bytes_on_the_relays_handlers_cost_it_nothing_and_it_serves_on():
    """An absurd declared length, garbage and a request cut short: each stream is closed with
    nothing read past the header, counted as refused, and the next request is answered."""

    async def run():
        relay = await SwarmNode.create(NodeOptions())
        stranger = await SwarmNode.create(NodeOptions(initial_peers=await relay.maddrs()))
        try:
            for protocol in (REACH, RELAY):
                for data in (
                    P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(1 << 16),
                    b"\xff" * 64,
                    P2P.MESSAGE_MARKER + (100).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"cut",
                ):
                    _, reader, writer = await stranger.p2p.call_binary_stream_handler(
                        PeerID.from_base58(relay.peer_id), protocol
                    )
                    writer.write(data)
                    await writer.drain()
                    if data.endswith(b"cut"):
                        writer.write_eof()
                    assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, no answer
                    writer.close()
            for _ in range(600):  # a stream cut short may end on our side before its handler has run
                if sum(relay.relay.refused.values()) == 6:
                    break
                await asyncio.sleep(0.05)
            assert sum(relay.relay.refused.values()) == 6, relay.relay.refused
            reply = await _relay_request(stranger, relay, rpb.RelayRequest(target=relay.peer_id, protocol=WHO))
            assert reply.error.endswith("is not held by this relay")
            assert (await ask(stranger.p2p, relay.peer_id, [], 30)).observed.startswith("/ip4/127.0.0.1/")
        finally:
            await stranger.shutdown()
            await relay.shutdown()

    asyncio.run(run())


def test_a_peer_whose_relay_dies_is_held_by_its_next_initial_peer():
    async def run():
        first, second = [await SwarmNode.create(NodeOptions()) for _ in range(2)]
        initial = [*(await first.maddrs())[:1], *(await second.maddrs())[:1]]
        held = await SwarmNode.create(NodeOptions(initial_peers=initial))
        try:
            held.reach.me = Reachability(BEHIND_NAT, relay=first.peer_id)
            await held.reach.serve_relayed()
            await asyncio.wait_for(held.reach.holding.held.wait(), 30)
            assert first.relay.held.keys() == {held.peer_id}
            await first.shutdown()
            for _ in range(600):  # it notices, fails once at the dead relay, then holds at the next
                if held.peer_id in second.relay.held:
                    break
                await asyncio.sleep(0.05)
            assert second.relay.held.keys() == {held.peer_id} and held.reach.me.relay == second.peer_id
        finally:
            await held.shutdown()
            await second.shutdown()

    asyncio.run(run())
