"""Per-flow pacing (swarm.transport.hivemind.flow.pacing): the fair-share arithmetic, the paced writer on a real
hivemind stream, and a swarm of peers that declare their link rates (real hivemind on loopback)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from _swarm_env import assert_same_run, smoke, split_batches, swarm_rows
from _util import frame
from hivemind.p2p import P2P

from protocols import stage_pb2 as pb
from protocols.framing import frame_parts
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.dht.announce import StageRecord
from swarm.transport.hivemind.flow.pacing import (
    MIN_OFFER_BITS,
    MIN_PIECE_BYTES,
    PAYLOAD_SHARE,
    PIECE_BYTES,
    FlowPacer,
    piece_bytes,
    send_paced,
    stage_flows,
)
from swarm.transport.hivemind.net.meta import micro_batch_payload
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.streams import PeerStream
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline


def test_flows_per_stage():
    assert [stage_flows(s, 4) for s in range(4)] == [1, 2, 2, 1]
    assert stage_flows(0, 1) == 0
    assert [stage_flows(s, 2) for s in range(2)] == [1, 1]


def test_a_flow_gets_the_smaller_of_the_senders_share_and_the_receivers_offer():
    middle, first = FlowPacer(100e6, 100e6, flows=2), FlowPacer(100e6, 100e6, flows=1)
    assert middle.download_share == pytest.approx(50e6 * PAYLOAD_SHARE)  # static, for the stage record
    assert middle.offer("s0", other_active=True) == pytest.approx(47e6)  # no payload sizes yet: half
    assert middle.offer("s0", other_active=False) == pytest.approx(94e6)
    first.heard("s1", middle.download_share, fallback=True)  # before any offer: the record's share
    assert first.rate("s1") == pytest.approx(47e6)
    first.heard("s1", middle.offer("s0", False))  # stage 1 waits for no gradients: the whole download
    assert first.rate("s1") == pytest.approx(94e6)
    first.heard("s1", middle.download_share, fallback=True)  # a record does not override an offer
    assert first.rate("s1") == pytest.approx(94e6)
    first.heard("s1", 0.0)  # says nothing
    assert first.rate("s1") == pytest.approx(94e6)
    first.heard("s1", 10e6)  # a slow receiver
    assert first.rate("s1") == 10e6
    for nonsense in (float("inf"), float("nan"), -float("inf")):  # not rates: they say nothing
        first.heard("s1", nonsense)
        assert first.rate("s1") == 10e6
    first.heard("s1", 1.0)  # a bit per second would hold the sending slot for ever: the floor instead
    assert first.rate("s1") == MIN_OFFER_BITS
    assert FlowPacer(None, None, 2).rate("s1") is None and FlowPacer(None, None, 2).flow("s1") is None
    assert FlowPacer(None, None, 2).offer("s0", True) == 0.0


def test_a_receiver_offers_its_incoming_flows_shares_by_their_payload_sizes():
    middle = FlowPacer(100e6, 100e6, flows=2)
    middle.arrived("s0", 300_000)  # activations from upstream
    assert middle.offer("s0", other_active=True) == pytest.approx(47e6)  # the other flow's size unknown
    middle.arrived("s2", 100_000)  # gradients from downstream
    assert middle.offer("s0", other_active=True) == pytest.approx(94e6 * 3 / 4)
    assert middle.offer("s2", other_active=True) == pytest.approx(94e6 / 4)
    assert middle.offer("s2", other_active=False) == pytest.approx(94e6)
    middle.arrived("s9", 300_000)  # a replacement downstream peer: the latest size counts
    assert middle.offer("s0", other_active=True) == pytest.approx(47e6)


def test_the_upload_is_shared_by_the_payloads_being_written_in_proportion_to_their_sizes():
    middle = FlowPacer(100e6, None, flows=2)
    up, down = middle.flow("s2"), middle.flow("s0")
    assert middle.rate("s2") == pytest.approx(94e6)  # nothing else being written
    with up.carrying(300_000):
        assert middle.rate("s0") == pytest.approx(47e6)  # not yet writing: an equal share
        assert middle.rate("s2") == pytest.approx(94e6)  # its own payloads do not count
        with down.carrying(100_000):  # shares by size: both payloads finish together
            assert middle.rate("s2") == pytest.approx(94e6 * 3 / 4)
            assert middle.rate("s0") == pytest.approx(94e6 / 4)
        assert middle.rate("s2") == pytest.approx(94e6)
    assert middle.rate("s0") == pytest.approx(94e6)
    assert middle.flow("s2") is up


def test_a_flow_follows_its_rate_piece_by_piece():
    middle = FlowPacer(None, None, flows=2)
    middle.heard("s2", 20e6)
    flow = middle.flow("s2")

    async def pieces():
        sizes = [flow.next_piece()]
        await flow.piece(sizes[-1])
        middle.heard("s2", 10e6)
        sizes.append(flow.next_piece())
        await flow.piece(sizes[-1])
        return sizes

    assert asyncio.run(pieces()) == [25_000, 12_500]  # 10 ms at each rate
    assert flow.bucket.rate_bits == 10_000_000 and flow.bucket.stats().bytes == 37_500


def test_pieces_last_about_ten_milliseconds_within_bounds():
    assert piece_bytes(50e6) == 62_500
    assert piece_bytes(1e9) == PIECE_BYTES  # fast links: per-write costs bound the piece
    assert piece_bytes(1e6) == MIN_PIECE_BYTES


@pytest.mark.peers
def test_the_peers_link_rates_are_checked():
    with pytest.raises(RuntimeError, match="--uplink: .*fast"):
        asyncio.run(SwarmNode.create(NodeOptions(uplink="fast")))


def test_a_record_without_a_download_share_reads_as_undeclared():
    record = StageRecord("p", 1, 4, [], download_share=12.5e6)
    assert StageRecord.from_value("p", record.to_value()).download_share == 12.5e6
    value = record.to_value()
    del value["download_share"]
    assert StageRecord.from_value("p", value).download_share == 0.0
    value["download_share"] = -5
    assert StageRecord.from_value("p", value).download_share == 0.0


def test_paced_messages_arrive_whole_on_a_hivemind_stream(swarm):
    """A payload framed in parts (a small prefix, then a view of the payload per chunk) and written
    in paced pieces reads back as the same protobuf messages as written unpaced; the bucket booked
    every byte, the prefixes with the piece after them."""
    node, server = swarm.hosts[0]
    received = []

    async def handler(info, reader, writer):
        async for message, data in PeerStream(reader, writer).replies():
            if data is not None:  # the chunk's data, received apart
                message.chunk.data = bytes(data)
            received.append(message)

    name = f"test-paced-{uuid.uuid4().hex[:6]}"
    pacer = FlowPacer(None, None, flows=1)
    payload = bytes(range(256)) * (5 * PIECE_BYTES // 256 + 7)  # two chunks, the first of 4 pieces
    head = pb.ResultHead(kind=pb.BACKWARD, route=["a", "b"])
    framed = list(frame_parts(pb.StageReply, "micro_batch", head, payload))

    async def send():
        await node.p2p.add_binary_stream_handler(name, handler)
        _, _, writer = await swarm.trainer.p2p.call_binary_stream_handler(node.p2p.peer_id, name)
        pacer.heard(node.peer_id, 800e6)
        flow = pacer.flow(node.peer_id)
        for parts in framed:
            await send_paced(parts, writer, flow)
        for parts in framed:
            await send_paced(parts, writer, None)  # unpaced, the same bytes on the wire
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        for _ in range(200):
            if len(received) == 2 * len(framed):
                break
            await asyncio.sleep(0.05)
        writer.close()
        await node.p2p.remove_binary_stream_handler(name)
        return flow.bucket.stats()

    stats = swarm.loop.run(send())
    assert len(framed) == 2 and all(len(parts) == 2 for parts in framed)
    assert [m.SerializeToString() for m in received] == [
        m.SerializeToString() for m in frame(pb.StageReply, "micro_batch", head, payload)
    ] * 2
    assert received[0].micro_batch == head and b"".join(m.chunk.data for m in received[:2]) == payload
    sizes = [sum(len(p) for p in parts) for parts in framed]
    assert stats.bytes == sum(sizes) and stats.calls == sum(-(-len(data) // PIECE_BYTES) for _, data in framed)


def test_a_swarm_with_declared_links_paces_every_stage_flow_and_trains_the_same(swarm, tmp_path):
    """Three stage peers declare 400 Mbit/s links: every boundary flow, both ways, goes through its
    neighbour's bucket at its share, and the run is the same as an unpaced one."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    peers = []
    for _ in range(3):
        node = swarm.loop.run(SwarmNode.create(swarm.options(uplink="400mbit", downlink="400mbit")))
        server = StageServer(node)
        swarm.loop.run(server.start())
        peers.append((node, server))
    try:
        hosted = [server.host(HostedStage(node, run_id, cfg, stage)) for stage, (node, server) in enumerate(peers)]
        for _, server in peers:
            swarm.loop.run(server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, 3, progress=False)
        ids = [h.node.peer_id for h in hosted]
        flows = {(s, n): f for s, h in enumerate(hosted) for n, f in h.pacer._flows.items()}
        trainer = swarm.trainer.peer_id  # stage 0 replies to it (a few bytes, paced at stage 0's upload)
        assert set(flows) == {
            (0, ids[1]),
            (1, ids[2]),
            (1, ids[0]),
            (2, ids[1]),
            (0, trainer),
        }  # activations down, gradients up
        for flow in flows.values():
            assert flow.bucket.stats().bytes > 0
            # a share by payload size, never more than the link
            assert 0 < flow.bucket.rate_bits <= 400e6 * PAYLOAD_SHARE
        assert all(h.awaiting == 0 for h in hosted)
        # the step is over: every receiver offers its whole download again (stage 0 offers it always)
        assert (
            hosted[0].pacer._offered[ids[1]] == hosted[1].pacer._offered[ids[0]] == pytest.approx(400e6 * PAYLOAD_SHARE)
        )
        forward = hosted[1].links.received[(ids[0], "forward", "train")]
        # every activation byte to stage 1 went through its flow
        assert flows[(0, ids[1])].bucket.stats().bytes >= forward
        assert_same_run(results.rows, swarm_rows(swarm, cfg, steps=3))
    finally:
        for node, server in peers:
            swarm.loop.run(server.stop())
            swarm.loop.run(node.shutdown())


def test_a_trainer_with_a_declared_uplink_paces_the_inputs_it_sends_stage_0(swarm):
    """The trainer's flow to stage 0 goes through its own bucket at the declared rate (the stage
    peers here declare nothing, so no offer lowers it); every input byte is booked."""
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    trainer = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True, uplink="300mbit")))
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1)])
    try:
        data = build_data(cfg)
        pipeline = SwarmPipeline(trainer, swarm.loop, cfg, run_id)
        pipeline.setup(Schedule.of(cfg, len(data[0]), 1).lr_horizon, len(data[0]), wait_s=20)
        items = split_batches(cfg, data, 1)[0]
        pipeline.run_many(items)
        inputs = sum(len(micro_batch_payload(batch, inputs=x)) for batch, x in items)
        ((peer, flow),) = pipeline.handoff.pacer._flows.items()
        assert peer == hosted[0].node.peer_id
        assert flow.bucket.rate_bits == int(300e6 * PAYLOAD_SHARE)
        assert flow.bucket.stats().bytes >= inputs
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(trainer.shutdown())
