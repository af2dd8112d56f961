"""A three-stage run on the shared test swarm that peers join and leave (tests/transport/hivemind's
joining tests), and the checks those tests make: each step against the same step in one process,
weights, routes and what a peer sent."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from _swarm_env import smoke, split_batches

from swarm.training.experiment import build_data
from swarm.training.loop import Schedule
from swarm.transport.hivemind.stage.host import HostedStage

STEPS = 5


def reference(cfg, data, steps: int = STEPS):
    from swarm.transport.local import build_local_pipeline

    return build_local_pipeline(cfg, Schedule.of(cfg, len(data[0]), steps).lr_horizon, capacity=len(data[0]))[0]


def route_only(router, keep: str, others) -> None:
    """Routes to `keep` alone (the others banned for now)."""
    router.bans.until = {peer: float("inf") for peer in others if peer != keep}


def wait_until(what, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def seen_ready(swarm, router, peer_id: str, stage: int = 1) -> None:
    """Waits until `router`'s fresh DHT lookup shows `peer_id` ready: the peer's new record is stored
    by a task it starts when it goes into service, so the record can lag its role."""

    def ready() -> bool:
        records = swarm.loop.run(router.peers(stage, refresh=True))
        return any(r.peer_id == peer_id and r.ready for r in records)

    wait_until(f"the DHT shows {peer_id[-8:]} ready", ready)


def joining_cfg():
    """Codecs without state across micro-batches: a micro-batch computes the same on any pair of peers."""
    return smoke("model.num_stages=3", "compression.forward=topk:0.2", "compression.backward=topk:reuse")


def step_both(pipeline, local, items) -> None:
    """One step through the swarm, checked against the same step in one process."""
    ours = [m["loss"] for m in pipeline.run_many(items)]
    assert ours == [m["loss"] for m in local.run_many(items)]
    assert pipeline.step() == pytest.approx(local.step())


def same_weights(a: HostedStage, b: HostedStage) -> bool:
    pairs = zip(a.runtime.module.parameters(), b.runtime.module.parameters(), strict=True)
    return all(torch.equal(p, q) for p, q in pairs)


def close_to(hosted: HostedStage, local, stage: int) -> bool:
    pairs = zip(hosted.runtime.module.parameters(), local.runtimes[stage].module.parameters(), strict=True)
    return all(torch.equal(p, r) for p, r in pairs)


def forward_sent(hosted: HostedStage) -> int:
    """Activation bytes `hosted` sent downstream in training, over all its links."""
    return sum(link.sent.get("forward.train", 0) for link in hosted.status().links if link.upstream)


class JoiningRun:
    """A three-stage run set up on the test swarm: stages 0..2 on the shared hosts 0..2 (stage 1 left
    out with `shared_stage1=False`), and, with `mortal`, a stage-1 peer on a host of its own that a
    test kills (`kill`). The trainer's pipeline, the same run in one process, and its steps."""

    def __init__(self, swarm, mortal: bool = True, shared_stage1: bool = True, steps: int = STEPS) -> None:
        self.swarm, self.cfg, self.run_id = swarm, joining_cfg(), uuid.uuid4().hex[:8]
        placement = [(0, 0), (1, 1), (2, 2)] if shared_stage1 else [(0, 0), (2, 2)]
        self.hosted = swarm.host(self.cfg, self.run_id, placement)
        self.node = self.server = self.mortal = None
        if mortal:
            self.node, self.server = swarm.mortal_host()
            self.mortal = self.server.host(HostedStage(self.node, self.run_id, self.cfg, 1))
            swarm.loop.run(self.server.announcer.announce_now())
        data = build_data(self.cfg)
        self.pipeline = swarm.pipeline(self.cfg, self.run_id, steps, data)
        self.local = reference(self.cfg, data, steps)
        self.steps = split_batches(self.cfg, data, steps)

    def step(self, n: int) -> None:
        step_both(self.pipeline, self.local, self.steps[n])

    def join(self, server=None, stage: int = 1) -> HostedStage:
        """A new peer of `stage` (default: on shared host 3) announces itself; the trainer sees it at
        its next step boundary."""
        server = server or self.swarm.hosts[3][1]
        joiner = server.host(HostedStage(server.node, self.run_id, self.cfg, stage))
        self.swarm.loop.run(server.announcer.announce_now())
        self.swarm.loop.run(self.pipeline.router.peers(stage, refresh=True))
        return joiner

    def kill(self) -> None:
        """The mortal peer's host goes away (its server, then its p2p daemon and DHT node)."""
        self.swarm.loop.run(self.server.stop())
        self.swarm.loop.run(self.node.shutdown())

    def close(self) -> None:
        self.swarm.unhost(self.run_id)
