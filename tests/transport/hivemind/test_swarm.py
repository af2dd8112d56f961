"""The swarm transport on real hivemind (loopback, never mocked).

The oracle: with the same config and seed, stage peers talking over hivemind's P2P reproduce the
single-process run's per-step losses, bytes and evaluations. Stage peers run in this process
(each with its own p2p daemon and DHT node) for speed; one test runs `python -m swarm lab` with
separate processes.
"""

from __future__ import annotations

import asyncio
import os
import uuid
import zlib

import pytest
import torch
from _swarm_env import STEPS, assert_same_run, local_rows, smoke, split_batches, swarm_rows
from _util import frame
from hivemind.utils.crypto import RSAPrivateKey

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from protocols.framing import ProtocolError, read_frame
from protocols.version import PROTOCOL_VERSION
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.dht.announce import discover
from swarm.transport.hivemind.dht.survey import format_table, survey
from swarm.transport.hivemind.net import loop
from swarm.transport.hivemind.net.calls import call
from swarm.transport.hivemind.net.meta import (
    batch_to_meta,
    carried_of,
    meta_to_batch,
    micro_batch_payload,
    raw_to_tensor,
    tensor_to_raw,
)
from swarm.transport.hivemind.net.node import DAEMON_THREADS, NodeOptions, SwarmNode
from swarm.transport.hivemind.net.streams import PeerStream
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline
from swarm.transport.hivemind.trust.sealed import DECISION, seal
from swarm.transport.hivemind.trust.signatures import Refused

# (stages, forward, backward); forward topk+ef21: test_oracle_with_clipping_and_two_peers_on_a_stage.
# Two stages: one boundary, both ends of it at the pipeline's ends; four stages have every kind of
# link end (the first's, middle stages' both ways, the last's), so the codecs run there.
CODECS = [
    (2, "none", "none"),
    (4, "none", "none"),
    (4, "subspace:4", "quant:4"),  # quant:4 both ways before: the forward basis is mirrored link state
    (4, "topk:0.1", "topk:reuse"),
    (4, "lowrank:4/warm+ef21", "topk:0.1+ef21"),  # /warm: each link's sender starts from its last delivered message
    (4, "topk:0.3+aqsgd", "lowrank:4/q8/warm+ef"),
]


@pytest.mark.parametrize(("stages", "forward", "backward"), CODECS, ids=[f"{n}-{f}|{b}" for n, f, b in CODECS])
def test_oracle_swarm_equals_single_process(swarm, tmp_path, stages, forward, backward):
    cfg = smoke(f"model.num_stages={stages}", f"compression.forward={forward}", f"compression.backward={backward}")
    assert_same_run(swarm_rows(swarm, cfg), local_rows(cfg, tmp_path))


def test_oracle_with_clipping_and_two_peers_on_a_stage(swarm, tmp_path):
    """Gradient clipping across stages, and a stage with two peers: one serves, both step."""
    cfg = smoke(
        "model.num_stages=3",
        "optimizer.grad_clip=0.05",
        "compression.forward=topk:0.2+ef21",
        "compression.backward=topk:reuse",
    )
    rows = swarm_rows(swarm, cfg, placement=[(0, 0), (1, 1), (1, 4), (2, 2)])
    assert_same_run(rows, local_rows(cfg, tmp_path))
    summary = rows[-1]  # two peers on a stage sum their gradients: every step closes by the rounds
    assert summary["closed_on_the_way"] == 0 and summary["round_calls"]["gather"] == 4 * summary["steps"]


def test_a_step_closes_on_the_way_with_the_same_floats(swarm, tmp_path):
    """One peer per stage, clipping on: no round trip after any step (the norms come back with the
    replies, the owner's decision goes out with the next micro-batches), and the losses of one process."""
    cfg = smoke(
        "model.num_stages=4",
        "optimizer.grad_clip=0.05",
        "compression.forward=quant:4+ef",
        "compression.backward=quant:4",
    )
    rows = swarm_rows(swarm, cfg)
    assert_same_run(rows, local_rows(cfg, tmp_path))
    summary = rows[-1]
    assert summary["closed_on_the_way"] == summary["steps"] == STEPS
    assert summary["round_calls"] == {}  # not one gather, set_grads or apply round


def test_only_the_owners_decision_closes_a_step(swarm):
    """The last step's decision is pending (no micro-batch brought it yet): one signed by another key
    is refused in one line and changes nothing; the owner's is applied once; settling then asks
    every peer by a round, and each answers with what it did."""
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        for items in split_batches(cfg, data, 2):  # (train() would evaluate after the last: that brings it)
            pipeline.run_many(items)
            pipeline.step()
        assert list(pipeline.closing.pending) == [1]  # step -> its decision
        decision = pipeline.closing.pending[1]
        assert decision.step == 1 and [h.state.steps for h in hosted] == [1, 1]
        forged = pb.StepDecision()
        forged.CopyFrom(decision)
        seal(RSAPrivateKey(), forged, DECISION)
        closing = hosted[1].chain.closing
        with pytest.raises(Refused, match="not signed by the run's owner"):
            swarm.loop.run(closing.decided(forged))
        before = [p.detach().clone() for p in hosted[1].runtime.module.parameters()]
        assert hosted[1].state.steps == 1
        swarm.loop.run(closing.decided(decision))
        swarm.loop.run(closing.decided(decision))  # a second micro-batch with it: applied once
        assert hosted[1].state.steps == 2
        after = list(hosted[1].runtime.module.parameters())
        assert any(not torch.equal(p, q) for p, q in zip(before, after, strict=True))
        pipeline.settle()  # stage 0 applies by the round; stage 1 answers as it did
        assert [h.state.steps for h in hosted] == [2, 2] and pipeline.closing.pending == {}
        assert pipeline.rounds.calls["apply"] == 2
    finally:
        swarm.unhost(run_id)


# ---- discovery and status ---------------------------------------------------------------------


def test_discovery_sees_several_peers_per_stage_and_status_lists_them(swarm):
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 2), (1, 3)])
    try:
        records = swarm.loop.run(discover(swarm.trainer, run_id, 1))
        assert {r.peer_id for r in records} == {swarm.hosts[i][0].peer_id for i in (1, 2, 3)}
        assert all(
            r.version == PROTOCOL_VERSION and r.codecs == {"forward": "topk:0.2", "backward": "topk:reuse"}
            for r in records
        )
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        assert len(pipeline.members[1]) == 3
        train(cfg, pipeline, data, ResultsWriter(None), 2, progress=False)
        rows = swarm.loop.run(survey(swarm.trainer, run_id))
        assert sorted(r.stage for r in rows) == [0, 1, 1, 1]
        assert all(r.reach.reachable and r.announced.ready for r in rows)
        served = [r for r in rows if r.work.processed > 0]
        assert {r.stage for r in served} == {0, 1}
        assert any(link["sent"] and link["received"] for r in served for link in r.work.links)
        downs = [link for r in served if r.stage == 0 for link in r.work.links]
        assert len(downs) > 1  # stage 0 spread its micro-batches over stage 1's peers (stateless codecs)
        trained = [link for link in downs if "forward.train" in link["sent"]]
        assert trained and all(  # topk:0.2: a fifth of the values, in fp16
            link["raw"]["forward.train"] / link["sent"]["forward.train"] > 4 for link in trained
        )
        down = max(downs, key=lambda link: sum(link["sent"].values()))
        ratio = sum(down["raw"].values()) / sum(down["sent"].values())  # with the evaluations' exact tensors
        assert ratio > 1
        assert all(r.reach.rtt_ms is not None and r.reach.rtt_ms > 0 for r in rows)
        table = format_table(rows)
        assert run_id in table and "b0down" in table and "ago" in table and f"(x{ratio:.1f})" in table and "ms" in table
    finally:
        swarm.unhost(run_id)


# ---- integrity, versions, unknown calls --------------------------------------------------------


@pytest.mark.peers
def test_peers_run_on_uvloop():
    """The peers' loops (peers._common.run_until_stopped, LoopThread) are uvloop's where it is installed."""

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert loop.run(loop_module()).startswith("uvloop")
    thread = loop.LoopThread("test-uvloop")
    try:
        assert thread.run(loop_module(), timeout=10).startswith("uvloop")
    finally:
        thread.stop()


def test_p2p_daemons_run_on_the_threads_a_peer_is_given(swarm):
    """--daemon_threads reaches the p2p daemon as GOMAXPROCS (0: Go's default), and only the daemon."""
    before = os.environ.get("GOMAXPROCS")
    nodes = [
        swarm.loop.run(SwarmNode.create(NodeOptions(initial_peers=swarm.maddrs, client_mode=True, daemon_threads=n)))
        for n in (DAEMON_THREADS, 3, 0)
    ]
    try:
        seen = []
        for node in nodes:
            with open(f"/proc/{node.p2p._child.pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            seen.append(env.get(b"GOMAXPROCS"))
        assert seen == [str(DAEMON_THREADS).encode(), b"3", None]
        assert os.environ.get("GOMAXPROCS") == before
    finally:
        for node in nodes:
            swarm.loop.run(node.shutdown())
    with pytest.raises(
        RuntimeError, match=r"^--daemon_threads must be 0 \(one per core\) or a positive integer, got -1$"
    ):
        swarm.loop.run(SwarmNode.create(NodeOptions(initial_peers=swarm.maddrs, daemon_threads=-1)))


def test_raw_tensors_and_batch_meta_round_trip_and_validate():
    batch = MicroBatch(3, 1, torch.arange(5), torch.tensor([1, 0, 2, 9, 4]), weight=0.25, exact=True)
    back = meta_to_batch(batch_to_meta(batch), carried_of(batch))
    assert back.key == batch.key and back.weight == 0.25 and back.exact
    assert torch.equal(back.sample_ids, batch.sample_ids) and torch.equal(back.targets, batch.targets)
    assert back.targets.dtype == back.sample_ids.dtype == torch.int64
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(raw_to_tensor(tensor_to_raw(x)), x)
    raw = tensor_to_raw(x)
    raw.data = raw.data[:-1]
    with pytest.raises(ProtocolError, match="bytes for shape"):
        raw_to_tensor(raw)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        raw_to_tensor(pb.RawTensor(dtype="complex32", shape=[1], data=b"12345678"))
    carried = carried_of(batch)
    carried.targets.CopyFrom(tensor_to_raw(torch.tensor([1, 2])))
    with pytest.raises(ProtocolError, match="do not match"):
        meta_to_batch(batch_to_meta(batch), carried)


async def _raw_call(p2p, peer_id: str, messages):
    """The reply to these request messages, sent as they are (a well-behaved caller frames them)."""
    stream = await PeerStream.open(p2p, peer_id)
    try:
        await stream.send([(message.SerializeToString(),) for message in messages])
        await stream.end()
        frame = await asyncio.wait_for(read_frame(stream.replies()), 20)
        return frame.head, frame.payload
    finally:
        stream.close()


def test_bad_payloads_versions_and_unknown_calls_get_one_line_errors(swarm):
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (hosted,) = swarm.host(cfg, run_id, [(0, 0)])
    peer = hosted.node.peer_id
    p2p = swarm.trainer.p2p
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        ids, x, y = (
            torch.arange(4),
            torch.stack([data[0][i][1] for i in range(4)]),
            torch.tensor([data[0][i][2] for i in range(4)]),
        )
        batch = MicroBatch(0, 0, ids, y)
        head = pb.MicroBatchHead(
            to=pb.Address(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0),
            sender=swarm.trainer.peer_id,
            batch=batch_to_meta(batch),
            budget_s=10,
        )
        head.admission.CopyFrom(pipeline.owner.admit(pipeline.session, swarm.trainer.peer_id, trainer=True))
        payload = micro_batch_payload(batch, inputs=x)
        good = list(frame(pb.StageRequest, "micro_batch", head, payload))

        corrupted = [pb.StageRequest() for _ in good]
        for a, b in zip(corrupted, good, strict=True):
            a.CopyFrom(b)
        corrupted[0].chunk.crc32 = zlib.crc32(b"something else")
        error, _ = swarm.loop.run(_raw_call(p2p, peer, corrupted))
        assert isinstance(error, pb.ErrorReply) and "checksum" in error.message and "\n" not in error.message

        # two chunks; only the first arrives
        big = list(frame(pb.StageRequest, "micro_batch", head, os.urandom(3 << 19)))
        error, _ = swarm.loop.run(_raw_call(p2p, peer, big[:1]))
        assert isinstance(error, pb.ErrorReply) and "truncated" in error.message

        miscounted = [pb.StageRequest()]
        miscounted[0].CopyFrom(good[0])
        miscounted[0].chunk.count = 5000  # a small payload claiming many chunks
        error, _ = swarm.loop.run(_raw_call(p2p, peer, miscounted))
        assert "bad chunk header" in error.message

        huge = [pb.StageRequest()]
        huge[0].CopyFrom(good[0])
        huge[0].chunk.total_length, huge[0].chunk.count = 1 << 40, (1 << 40) >> 20
        error, _ = swarm.loop.run(_raw_call(p2p, peer, huge))
        assert "exceeds this peer's limit" in error.message or "here at once (limit" in error.message

        fewer_rows = list(frame(pb.StageRequest, "micro_batch", head, micro_batch_payload(batch, inputs=x[:3])))
        error, _ = swarm.loop.run(_raw_call(p2p, peer, fewer_rows))
        assert "for 4 samples" in error.message

        future = pb.MicroBatchHead()
        future.CopyFrom(head)
        future.to.protocol_version = 99
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", future, payload)))
        assert "protocol version 99 is not supported" in error.message

        elsewhere = pb.MicroBatchHead()
        elsewhere.CopyFrom(head)
        elsewhere.to.stage = 5
        error, _ = swarm.loop.run(_raw_call(p2p, peer, frame(pb.StageRequest, "micro_batch", elsewhere, payload)))
        assert "does not host stage 5" in error.message

        # targets that do not fit their shape: a malformed payload, its sender banned (not the trainer here)
        member = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
        try:
            from_member = pb.MicroBatchHead()
            from_member.CopyFrom(head)
            from_member.sender = member.peer_id
            from_member.admission.CopyFrom(pipeline.owner.admit(pipeline.session, member.peer_id, trainer=True))
            carried, _ = envelope.unpack(payload)
            carried.targets.data = b"\x00"
            bad = envelope.pack(carried)
            error, _ = swarm.loop.run(
                _raw_call(member.p2p, peer, frame(pb.StageRequest, "micro_batch", from_member, bad))
            )
            assert error.message.startswith("malformed payload: targets: 1 bytes for shape (4,)")
            error, _ = swarm.loop.run(
                _raw_call(member.p2p, peer, frame(pb.StageRequest, "micro_batch", from_member, payload))
            )
            assert "is banned for a while" in error.message
        finally:
            swarm.loop.run(member.shutdown())

        # a request of no kind: bytes no peer of the protocol writes, its sender banned (not the trainer)
        headless = [pb.StageRequest(chunk=good[0].chunk)]
        vandal = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
        try:
            error, _ = swarm.loop.run(_raw_call(vandal.p2p, peer, headless))
            assert isinstance(error, pb.ErrorReply) and error.message == "the first message has no head"
            error, _ = swarm.loop.run(_raw_call(vandal.p2p, peer, good))
            assert "is banned for a while" in error.message
        finally:
            swarm.loop.run(vandal.shutdown())

        with pytest.raises(Exception):  # noqa: B017 (hivemind reports an unknown protocol in several ways)
            swarm.loop.run(
                asyncio.wait_for(p2p.call_binary_stream_handler(hosted.node.p2p.peer_id, "hivepipe.bogus"), 10)
            )
        streams = swarm.trainer.streams
        current = pb.Address(protocol_version=PROTOCOL_VERSION)
        reply = swarm.loop.run(call(streams, peer, "info", pb.InfoRequest(to=current), b"", 10)).head
        assert reply.peer_id == peer and [s.run_id for s in reply.stages] == [run_id]
        with pytest.raises(RemoteError, match="protocol version 0 is not supported"):
            swarm.loop.run(call(streams, peer, "info", pb.InfoRequest(to=pb.Address(protocol_version=0)), b"", 10))
        with pytest.raises(RemoteError, match="config mismatch"):
            to = pb.Address(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=0)
            request = pb.SetupRequest(to=to, config_digest="0" * 16, lr_horizon=2, session=pipeline.session)
            request.admission.CopyFrom(pipeline.owner.admit(pipeline.session, peer, 0))
            swarm.loop.run(call(streams, peer, "setup", request, b"", 10, pipeline.owner.key))

        # the peer kept serving: a good micro-batch still trains
        metrics = pipeline.run_many([(batch, x)])[0]
        assert metrics["count"] == 4 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert hosted.meters.processed == 1
    finally:
        swarm.unhost(run_id)


# ---- separate processes ---------------------------------------------------------------------


def test_in_process_shaping_paces_every_payload_a_peer_sends(swarm):
    """Peers created with a shape rate send requests and replies through their token bucket."""
    cfg = smoke("model.num_stages=2")
    run_id = uuid.uuid4().hex[:8]
    shaped = [
        swarm.loop.run(SwarmNode.create(swarm.options(shape_rate="200mbit", shape_delay="1ms", client_mode=client)))
        for client in (False, False, True)
    ]
    servers = [StageServer(node) for node in shaped[:2]]
    try:
        for stage, server in enumerate(servers):
            swarm.loop.run(server.start())
            server.host(HostedStage(server.node, run_id, cfg, stage))
            swarm.loop.run(server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = SwarmPipeline(shaped[2], swarm.loop, cfg, run_id)
        pipeline.setup(Schedule.of(cfg, len(data[0]), 2).lr_horizon, len(data[0]), wait_s=20)
        items = split_batches(cfg, data, 1)[0]
        pipeline.run_many(items)
        pipeline.step()
        inputs = sum(len(micro_batch_payload(batch, inputs=x)) for batch, x in items)
        sent = pipeline.link_bytes()
        stage0, stage1, trainer = (node.egress.stats() for node in shaped)
        assert trainer.bytes > inputs and trainer.rate_bits == 200_000_000 and trainer.delay_s == 0.001
        assert stage0.bytes > sent["boundary0.forward.train"]  # activations out (and replies to the trainer)
        assert stage1.bytes > sent["boundary0.backward.train"]  # gradients back, as replies
    finally:
        for server in servers:
            swarm.loop.run(server.stop())
        for node in shaped:
            swarm.loop.run(node.shutdown())
