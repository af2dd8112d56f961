"""Streams are kept per neighbour and reused (streams.StreamPool, streams.Requests):
what a reused stream carries, when one is not reused, and that runs stay exact."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from _swarm_env import assert_same_run, local_rows, smoke, swarm_rows
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.training.experiment import build_data
from swarm.transport.hivemind.net.calls import Exchange
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.net.streams import StreamPool
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trust.owner import Owner

OWNER = Owner(RSAPrivateKey.process_wide(), "")


def _set_up(loop, hosted: HostedStage) -> None:
    """The stage set up for session "s" as its owner's signed setup call would do it."""
    owner = Owner(OWNER.key, hosted.run_id)
    hosted.gate.owner = owner.peer_id
    request = pb.SetupRequest(
        config_digest=hosted.place.digest,
        session="s",
        lr_horizon=10,
        capacity=400,
        admission=owner.admit("s", hosted.node.peer_id, hosted.stage),
    )
    loop.run(hosted.setup(request))


def _stage0_call(streams: StreamPool, peer: str, run_id: str, sender: str, data, seq: int) -> Exchange:
    """An eval micro-batch for a one-stage run from its trainer: stage 0 answers DONE with its metrics."""
    x = torch.stack([data[1][i][1] for i in range(4)])
    y = torch.tensor([data[1][i][2] for i in range(4)])
    batch = MicroBatch(0, seq, torch.arange(4), y, mode=Mode.EVAL)
    head = pb.MicroBatchHead(
        to=address(run_id, 0), sender=sender, batch=batch_to_meta(batch), budget_s=10, epoch=0, seq=seq
    )
    head.admission.CopyFrom(Owner(OWNER.key, run_id).admit("s", sender, trainer=True))
    return Exchange(streams, peer, "micro_batch", head, micro_batch_payload(batch, inputs=x))


async def _close_idle(pools: list[StreamPool]) -> None:
    """In the swarm's loop, whose streams they are."""
    for pool in pools:
        pool.close()


def test_a_run_opens_about_one_stream_per_micro_batch_in_flight_and_stays_exact(swarm, tmp_path):
    """40 micro-batches through 4 stages, 8 in flight: each of the 4 links opens at most 8 streams,
    where a stream per micro-batch would open 40; the run equals the single-process one."""
    cfg = smoke("train.in_flight=8", "train.micro_batches=8")
    nodes = [node for node, _ in swarm.hosts[:4]]  # swarm_rows hosts stage s on host s
    callers = [swarm.trainer.streams, *(node.streams for node in nodes[:3])]
    downstream = [node.peer_id for node in nodes]
    links = list(zip(callers, downstream, strict=True))
    # from clean pools: streams an earlier test's run left idle on these links would be reused (none
    # opened) and counted idle below
    swarm.loop.run(_close_idle(callers))
    before = [pool.opened[peer] for pool, peer in links]
    rows = swarm_rows(swarm, cfg, steps=5)
    opened = [pool.opened[peer] - b for (pool, peer), b in zip(links, before, strict=True)]
    micro_batches = sum(1 for r in rows if r["type"] == "step") * cfg.train.micro_batches
    assert micro_batches == 40
    assert all(1 <= n <= cfg.train.in_flight for n in opened), opened
    assert [pool.idle(peer) for pool, peer in links] == opened  # every stream came back after its last reply
    assert_same_run(rows, local_rows(cfg, tmp_path))


def test_streams_the_server_closed_or_kept_too_long_are_replaced(swarm):
    """A server closes streams idle for its `server_idle_s`; the caller notices and opens a new one
    rather than failing a micro-batch. A stream idle for the pool's `keep_s` is not reused either."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    node = swarm.loop.run(SwarmNode.create(swarm.options(settings=Settings.of(server_idle_s=0.5))))
    server = StageServer(node)
    swarm.loop.run(server.start(announce=False))
    clock = [100.0]
    streams = StreamPool(swarm.trainer.p2p, keep_s=10.0, end_wait_s=2.0, clock=lambda: clock[0])
    try:
        server.host(HostedStage(node, run_id, cfg, 0))
        _set_up(swarm.loop, server.hosted[(run_id, 0)])
        data = build_data(cfg)

        def one(seq: int) -> pb.ResultHead:
            call = _stage0_call(streams, node.peer_id, run_id, swarm.trainer.peer_id, data, seq)
            frame = swarm.loop.run(call.reply(20))
            call.finish()
            return frame.head

        assert one(0).kind == pb.DONE and one(1).kind == pb.DONE
        # the second micro-batch rode the first's stream
        assert streams.opened[node.peer_id] == 1 and streams.idle(node.peer_id) == 1
        time.sleep(1.5)  # past the server's idle timeout: it closed its end
        assert one(2).kind == pb.DONE
        assert streams.opened[node.peer_id] == 2
        clock[0] += 11.0  # kept past keep_s on our side
        assert one(3).kind == pb.DONE
        assert streams.opened[node.peer_id] == 3 and streams.idle(node.peer_id) == 1
    finally:
        streams.close()
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())


class _Held:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_streams_to_a_neighbour_no_longer_called_are_closed_once_expired():
    """A caller that moved on to another replica does not keep its old neighbour's streams (and
    their sockets to the daemon) for ever."""
    clock = [0.0]
    pool = StreamPool(p2p=None, keep_s=10.0, clock=lambda: clock[0])
    old, fresh = _Held(), _Held()
    pool.give_back("old-replica", old)
    clock[0] = 5.0
    pool.give_back("new-replica", fresh)
    assert not old.closed and pool.idle("old-replica") == 1
    clock[0] = 10.5
    pool.give_back("new-replica", _Held())
    assert old.closed and pool.idle("old-replica") == 0
    assert not fresh.closed and pool.idle("new-replica") == 2


def test_a_refused_micro_batch_closes_its_stream_and_the_next_one_works(swarm):
    """An error reply may leave part of a request unread: that stream is closed, never pooled."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (hosted,) = swarm.host(cfg, run_id, [(0, 0)])
    peer = hosted.node.peer_id
    streams = StreamPool(swarm.trainer.p2p, keep_s=20.0, end_wait_s=2.0)
    try:
        _set_up(swarm.loop, hosted)
        data = build_data(cfg)
        good = _stage0_call(streams, peer, run_id, swarm.trainer.peer_id, data, 0)
        swarm.loop.run(good.reply(20))
        good.finish()
        assert streams.idle(peer) == 1
        bad = _stage0_call(streams, peer, "no-such-run", swarm.trainer.peer_id, data, 1)
        with pytest.raises(RemoteError, match="does not host stage 0 of run 'no-such-run'"):
            swarm.loop.run(bad.reply(20))
        bad.finish()
        # the bad call took the pooled stream and closed it
        assert streams.idle(peer) == 0 and streams.opened[peer] == 1
        # the refused one never reached the stage
        again = _stage0_call(streams, peer, run_id, swarm.trainer.peer_id, data, 1)
        result = swarm.loop.run(again.reply(20)).head
        again.finish()
        assert result.kind == pb.DONE and streams.opened[peer] == 2 and streams.idle(peer) == 1
    finally:
        streams.close()
        swarm.unhost(run_id)


def test_one_stream_carries_micro_batch_after_micro_batch_until_the_callers_end_marker(swarm):
    """The server serves requests one after another on a stream until the caller's end marker."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (hosted,) = swarm.host(cfg, run_id, [(0, 0)])
    streams = StreamPool(swarm.trainer.p2p, keep_s=20.0, end_wait_s=2.0)
    try:
        _set_up(swarm.loop, hosted)
        data = build_data(cfg)
        for seq in range(3):
            call = _stage0_call(streams, hosted.node.peer_id, run_id, swarm.trainer.peer_id, data, seq)
            result = swarm.loop.run(call.reply(20)).head
            call.finish()
            assert result.kind == pb.DONE and result.metrics["count"] == 4
        assert streams.opened[hosted.node.peer_id] == 1
        ((stream, _),) = streams._idle[hosted.node.peer_id]

        async def end_and_wait():
            await P2P.send_protobuf(P2P.END_OF_STREAM, stream.writer)
            return await stream.reader.read()  # the server closes its end: EOF, nothing else

        assert swarm.loop.run(end_and_wait()) == b""
        assert stream.closed
    finally:
        streams.close()
        swarm.unhost(run_id)
