"""Cheap to send must be cheap to refuse (issue 58). A stranger holds 2 MiB messages of random
bytes and of zeros open at a stage peer of a training run, then completes them: each is refused
at about the cost of reading it (zeros once cost 2.3 s of the peer's event loop each), the peer
answers anyone's status within a second meanwhile, the stranger is banned, and the run's losses
are one process's. A member's float targets are refused where they are decoded, as its fault."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from _swarm_env import STEPS, assert_same_run, local_rows, smoke

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.errors import RemoteError
from protocols.message import Encoded, RawPart
from swarm.bench.fuzz_floods import Held, flood_messages
from swarm.engine.build import build_staged_model
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.net.calls import call
from swarm.transport.hivemind.net.loop import LoopThread
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

INFO_S = 1.0  # the bound: a peer answers a status call within a second throughout


def test_a_strangers_held_zeros_and_random_bytes_cost_it_a_ban_and_the_run_nothing(swarm, tmp_path):
    cfg = smoke()
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    target, server = hosted[1], swarm.hosts[1][1]
    # the stranger and a status reader run on a loop of their own, as another machine's would: what
    # they see of the peer is not slowed by its own loop
    outside = LoopThread("outside")
    stranger, reader = (outside.run(SwarmNode.create(swarm.options(client_mode=True))) for _ in range(2))
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        peer = target.node.peer_id

        def status():
            return call(reader.streams, peer, "info", pb.InfoRequest(to=address(run_id)), b"", INFO_S)

        outside.run(call(reader.streams, peer, "info", pb.InfoRequest(to=address(run_id)), b"", 30))  # dialled
        messages = flood_messages("random 2 MiB, held", 2) + flood_messages("zero-filled 2 MiB, held", 4)

        async def attack():
            while not target.meters.processed:  # the run is under way
                await asyncio.sleep(0.01)
            held = await Held.open(stranger.p2p, peer, messages)
            try:
                return await held.complete(len(messages), status, limit_s=30)
            finally:
                held.close()

        attacking = asyncio.run_coroutine_threadsafe(attack(), outside.loop)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        flooded = attacking.result(timeout=120)
        # every status call meanwhile answered within its second; every message refused in one line,
        # before protobuf parsed it, or its stream closed
        assert len(flooded.info_s) == len(messages) and None not in flooded.info_s, flooded.info_s
        assert all(outcome in ("refused", "closed") for outcome, _ in flooded.outcomes), flooded.outcomes
        outcome, reason = flooded.outcomes[0]
        assert outcome == "refused" and reason.startswith("a StageRequest of 2097152 bytes besides"), reason
        assert server.refusals.banned.failures.get(stranger.peer_id, 0) >= 1
        assert any(e.kind == "ban" and stranger.peer_id[-8:] in e.text for e in server.events.last())
        assert_same_run(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.unhost(run_id)
        for node in (stranger, reader):
            outside.run(node.shutdown())
        outside.stop()


def test_a_members_float_targets_are_refused_where_decoded_as_its_fault(swarm):
    """A member admitted to the stage before the last sends it a micro-batch whose targets are
    floats (the loss takes class indices): refused in one line naming the targets, before any
    model sees them, and the member banned (it once reached the loss: an unclassified RuntimeError)."""
    cfg = smoke("compression.forward=none", "compression.backward=none")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(cfg.model.num_stages)])
    last, server = hosted[-1], swarm.hosts[len(hosted) - 1][1]
    member = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 1, data)
        x = torch.stack([data[0][i][1] for i in range(4)])
        with torch.no_grad():
            for stage in build_staged_model(cfg).stages[:-1]:
                x = stage(x)
        batch = MicroBatch(0, 0, torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        payload = micro_batch_payload(batch, wire.encode(Encoded(tuple(x.shape), torch.float32, RawPart(x))))
        head = pb.MicroBatchHead(
            to=address(run_id, last.stage), sender=member.peer_id, batch=batch_to_meta(batch), budget_s=10
        )
        head.admission.CopyFrom(pipeline.owner.admit(pipeline.session, member.peer_id, last.stage - 1))
        with pytest.raises(RemoteError) as caught:
            swarm.loop.run(call(member.streams, last.node.peer_id, "micro_batch", head, payload, 20))
        message = str(caught.value)
        assert message.startswith("malformed payload: targets: float32 values of shape (4,)"), message
        assert "\n" not in message and last.meters.processed == 0
        assert server.refusals.banned.banned(member.peer_id)
        with pytest.raises(RemoteError, match="is banned for a while"):
            swarm.loop.run(call(member.streams, last.node.peer_id, "micro_batch", head, payload, 20))
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(member.shutdown())


def test_a_sender_whose_refusals_cost_more_than_its_share_of_a_core_is_banned(swarm):
    """Well-formed requests a peer refuses (an unsigned setup) ban nobody by themselves; a sender
    whose refusals cost the peer more CPU than its budget (here a millionth of a core) is banned."""
    cfg = smoke("model.num_stages=1")
    run_id = uuid.uuid4().hex[:8]
    (shared,) = swarm.host(cfg, run_id, [(0, 0)])
    budget = swarm.options(settings=Settings.of(call_timeout_s=30, read_timeout_s=10, refusal_cpu_share=1e-6))
    node = swarm.loop.run(SwarmNode.create(budget))
    server = StageServer(node)
    swarm.loop.run(server.start(announce=False))
    server.host(HostedStage(node, run_id, cfg, 0))
    stranger = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    setup = pb.SetupRequest(to=address(run_id, 0))

    def refusal(peer: str) -> str:
        with pytest.raises(RemoteError) as caught:
            swarm.loop.run(call(stranger.streams, peer, "setup", setup, b"", 20))
        assert caught.value.code == pb.REFUSED
        return str(caught.value)

    try:
        for peer in (shared.node.peer_id, node.peer_id):
            assert "banned" not in refusal(peer)  # unsigned: refused, its sender not to blame
        assert "banned" not in refusal(shared.node.peer_id)  # a tenth of a core: far from it
        assert "is banned for a while" in refusal(node.peer_id)
        assert any("cost more than 1e-06 of a core over 10s" in e.text for e in server.events.last() if e.kind == "ban")
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(server.stop())
        for created in (node, stranger):
            swarm.loop.run(created.shutdown())
