"""The swarm's copies from a peer with a declared uplink, on real hivemind (loopback): a holder's
fetch goes at the uplink's copy share (swarm.transport.hivemind.flow.background), the trainer's next
snapshot round waits until the last round's copies have arrived, and a restore's download is not
paced."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from _swarm_env import AfterStep, smoke

from protocols import stage_pb2 as pb
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.transport.hivemind.flow.background import COPY_SHARE
from swarm.transport.hivemind.flow.pacing import MIN_OFFER_BITS, PAYLOAD_SHARE
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trainer.copies import FETCH_MARGIN, fetch_seconds

STEPS = 8
UPLINK_BITS = 2_000_000


class _Frame:
    def __init__(self, nbytes: int, bits: float) -> None:
        self.head = pb.SnapshotReply(bytes=nbytes, background_bits=bits)


def test_a_rounds_fetch_time_is_its_slowest_stage_copy_times_its_holders_at_the_senders_copy_rate():
    taken = {(0, "a"): _Frame(100_000, 800_000.0), (0, "b"): _Frame(100_000, 0.0), (1, "c"): _Frame(3000, 0.0)}
    # stage 0's two holders fetch from "a" (2 x 100,000 bytes at 100,000 bytes/s); stage 1's copy is unpaced
    assert fetch_seconds(taken, {0: 2, 1: 1}, {0: "a", 1: "c"}) == pytest.approx(2.0 * FETCH_MARGIN)
    assert fetch_seconds(taken, {0: 2}, {0: "b"}) == 0.0  # its first peer sends unpaced: no wait
    # a peer reporting a rate of next to nothing, or not a rate, cannot hold the next rounds off
    crawling = {(0, "a"): _Frame(8000, 1e-9), (0, "b"): _Frame(8000, float("nan"))}
    assert fetch_seconds(crawling, {0: 1}, {0: "a"}) == pytest.approx(8000 * 8 / MIN_OFFER_BITS * FETCH_MARGIN)
    assert fetch_seconds(crawling, {0: 1}, {0: "b"}) == 0.0


def test_copies_from_a_declared_uplink_go_at_its_copy_share_and_the_next_round_waits_for_them(swarm, caplog):
    cfg, run_id = smoke("model.num_stages=3"), uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (2, 2)])
    node = swarm.loop.run(SwarmNode.create(swarm.options(uplink=str(UPLINK_BITS))))
    server = StageServer(node)
    swarm.loop.run(server.start())
    paced = server.host(HostedStage(node, run_id, cfg, 1)).snapshots
    swarm.loop.run(server.announcer.announce_now())
    data = build_data(cfg)
    seen: list[tuple[int, int]] = []  # (copy bytes, bytes the copy flow had sent) at each round after the first
    try:
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data, snapshot_every=1)
        recovery, rounds = pipeline.recovery, []
        original = recovery.snapshot

        async def noted(step, position):
            if recovery.due(step) and recovery.taken is not None:
                held = hosted[1].snapshots.copies.get((1, recovery.taken))  # stage 2 holds stage 1's copies
                seen.append((len(held.payload) if held else -1, paced.sending.bucket._bytes))
            await original(step, position)
            rounds.append(step)

        def until_the_copies_are_due():  # the trainer's own word of when the last round's copies are in
            time.sleep(max(0.0, recovery.fetched_by - time.monotonic()))

        recovery.snapshot = noted
        with caplog.at_level(logging.WARNING, logger="swarm.transport.hivemind.trainer.recovery"):
            train(cfg, pipeline, data, AfterStep(2, until_the_copies_are_due), STEPS, progress=False)
        assert paced.sending.rate_bits == pytest.approx(UPLINK_BITS * PAYLOAD_SHARE * COPY_SHARE)
        assert len(rounds) >= 2, rounds  # the hook waited for the first round's copies: a second one followed
        # every later round came after the holder had the last round's copy, all of it sent paced
        assert seen and all(size > 0 and sent >= size for size, sent in seen), seen
        assert "holds no complete set" not in caplog.text
        assert paced.paced(pb.StateRequest(snapshot=True)) is None  # a restore's download goes at once
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())
