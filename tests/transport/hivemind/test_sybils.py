"""Sybil pressure, scripted on real hivemind (loopback): many fresh identities join a stage of an
open run and return wrong results. Admission limits are per identity and a key costs nothing, so
what keeps their work out of the steps is `train.verify_probation`: a new identity's every
micro-batch is checked against a trusted peer until enough of its results matched."""

from __future__ import annotations

import uuid

import pytest
import torch
from _swarm_env import AfterStep, local_rows, smoke

from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.transport.hivemind.stage.host import HostedStage

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 6
SYBILS = 4


def _wrong_member(swarm, cfg, run_id: str, wrong: list):
    """A fresh identity on a host of its own serving stage 1 with weights of its own from its first
    micro-batch (finite, well-formed, wrong); the keys it computed go into `wrong`."""
    node, server = swarm.mortal_host()
    hosted = server.host(HostedStage(node, run_id, cfg, 1))
    forward = hosted.work.forward

    def off(batch, data, ends):
        if not any(peer == node.peer_id for peer, _ in wrong):
            with torch.no_grad():
                next(hosted.runtime.module.parameters()).add_(1e-2)
        wrong.append((node.peer_id, batch.key))
        return forward(batch, data, ends)

    hosted.work.forward = off
    swarm.loop.run(server.announcer.announce_now())
    return node, server


@pytest.mark.parametrize("probation", [0, 2], ids=["fraction-only", "probation"])
def test_many_fresh_identities_computing_wrong_results_reach_no_step_on_probation(swarm, tmp_path, probation):
    """Stage 1 has one honest incumbent; after step 1 four fresh identities announce themselves for
    it (admitted two per step, the admission limits), each computing wrong results from its first
    micro-batch. The owner checks micro-batch 0 of every step (`train.verify` 0.25, drawn here
    without chance). Counted: the micro-batches whose step kept a result of a wrong identity. With
    the fraction only, the unchecked ones reach the steps; with `verify_probation` every
    micro-batch a new identity serves is checked against the incumbent, none reaches a step, every
    identity that served is left out, and the losses are one process's."""
    cfg = smoke("model.num_stages=3", "train.verify=0.25", f"train.verify_probation={probation}")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    hosts, wrong, reached = [], [], []

    def sybils_join() -> None:
        hosts.extend(_wrong_member(swarm, cfg, run_id, wrong) for _ in range(SYBILS))
        swarm.loop.run(pipeline.router.peers(1, refresh=True))  # the trainer sees them at the next boundary

    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        verification = pipeline.dispatch.verification
        verification.draw = lambda items: frozenset({0})
        check = verification.check

        async def counted(items, results, picks):  # what the step keeps, once its checks are done
            redone = await check(items, results, picks)
            sybils = {node.peer_id for node, _ in hosts}
            step = items[0][0].step
            reached.extend((step, i) for i, route in pipeline.position.routes.items() if route[1] in sybils)
            return redone

        verification.check = counted
        results = AfterStep(1, sybils_join)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        served = {peer for peer, _ in wrong}
        print(
            f"\nverify_probation={probation}: {len(served)} of {SYBILS} identities served {len(wrong)} micro-batches;"
            f" {len(reached)} of their results reached a step; checks {verification.checks},"
            f" mismatches {verification.mismatches}"
        )
        assert served, "no wrong identity was ever routed to"
        if not probation:
            assert reached, "every wrong result was checked: the run shows nothing"
            return
        assert reached == []
        assert served <= pipeline.membership.convicted
        local = [r["loss"] for r in local_rows(cfg, tmp_path, STEPS) if r["type"] == "step"]
        assert [r["loss"] for r in results.rows if r["type"] == "step"] == local
    finally:
        swarm.unhost(run_id)
        for node, server in hosts:
            swarm.loop.run(server.stop())
            swarm.loop.run(node.shutdown())
