"""The relay and the reachability check between real hivemind nodes on loopback
(swarm.transport.hivemind.net.relay and .reach): what they do for a peer behind NAT, and what
they refuse a stranger."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P, PeerID

from protocols import reach_pb2 as rpb
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.reach import BEHIND_NAT, PUBLIC, Reachability, ask
from swarm.transport.hivemind.net.relay import RELAY, RELAYED, REQUEST_BYTES
from swarm.transport.hivemind.net.streams import read_one


async def _relay_request(node: SwarmNode, relay: SwarmNode, request: rpb.RelayRequest) -> rpb.RelayReply:
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(relay.peer_id), RELAY)
    await P2P.send_protobuf(request, writer)
    try:
        return await read_one(reader, rpb.RelayReply, REQUEST_BYTES)
    finally:
        writer.close()


async def _swarm_with_a_peer_behind_nat():
    """A relay (the bootstrap), a peer held by it as if behind NAT, and a third peer. The held
    peer's RELAYED handler records who each stream says it is from (None: refused)."""
    relay = await SwarmNode.create(NodeOptions())
    initial = await relay.maddrs()
    held = await SwarmNode.create(NodeOptions(initial_peers=initial))
    other = await SwarmNode.create(NodeOptions(initial_peers=initial))
    assert relay.reach.me.state != BEHIND_NAT and held.reach.me.state == PUBLIC  # loopback dials back
    held.reach.me = Reachability(BEHIND_NAT, relay=relay.peer_id)  # what a NATed peer's check finds
    held.reach.hold()
    await asyncio.wait_for(held.reach.held.wait(), 30)
    callers: asyncio.Queue = asyncio.Queue()

    async def relayed(info, reader, writer):
        await callers.put(await held.reach.caller(info, reader))
        writer.close()

    await held.p2p.add_binary_stream_handler(RELAYED, relayed)
    return relay, held, other, callers


def test_a_relayed_stream_names_its_caller_and_only_the_relay_may_name_one():
    async def run():
        relay, held, other, callers = await _swarm_with_a_peer_behind_nat()
        try:
            # through the relay: the held peer learns the real caller
            other.reach.learn(held.peer_id, relay.peer_id)
            _, writer = await other.reach.through(relay.peer_id, held.peer_id)
            assert await asyncio.wait_for(callers.get(), 30) == other.peer_id
            writer.close()
            # straight to the held peer's RELAYED handler, claiming to be the relay's caller: refused
            _, reader, writer = await other.p2p.call_binary_stream_handler(PeerID.from_base58(held.peer_id), RELAYED)
            await P2P.send_protobuf(rpb.Relayed(caller=relay.peer_id), writer)
            assert await asyncio.wait_for(callers.get(), 30) is None
            assert held.reach.arrived == {"relayed": 1, "refused": 1}
            # the relay relays only to peers it holds
            reply = await _relay_request(other, relay, rpb.RelayRequest(target=other.peer_id))
            assert reply.error == f"peer {other.peer_id[-8:]} is not held by this relay"
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
