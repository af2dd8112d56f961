"""Verification that nobody can turn against an honest peer, scripted on real hivemind (loopback): a
member elsewhere on a checked route answers the check differently, to get one of the two honest
peers being compared left out. The stages' signed accounts (trust.evidence) find the first stage
where equal inputs gave other outputs: the framer's."""

from __future__ import annotations

import contextlib
import uuid

import pytest
import torch
from _swarm_env import AfterStep, local_rows, smoke

from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.transport.hivemind.routing.router import NoPeerError
from swarm.transport.hivemind.stage.host import HostedStage

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 5


def _framer(swarm, cfg, run_id: str, lied: list):
    """A stage-2 member on a host of its own that computes honestly, except when a micro-batch comes
    a second time (a new attempt of a (step, index) it served: a check's second run, or a retry):
    then it computes it with weights shifted a little (finite, well-formed, wrong). What it lied on
    goes into `lied`."""
    node, server = swarm.mortal_host()
    hosted = server.host(HostedStage(node, run_id, cfg, 2))
    seen: set[tuple] = set()
    forward = hosted.work.forward

    def lying(batch, data, ends):
        if batch.key not in seen:
            seen.add(batch.key)
            return forward(batch, data, ends)
        lied.append(batch.key)
        weight = next(hosted.runtime.module.parameters())
        kept = weight.detach().clone()
        with torch.no_grad():
            weight.add_(1e-2)
        try:
            return forward(batch, data, ends)
        finally:
            with torch.no_grad():
                weight.copy_(kept)  # its own weights back, bit for bit

    hosted.work.forward = lying
    swarm.loop.run(server.announcer.announce_now())
    return node, server


def test_a_member_on_a_checked_route_that_answers_the_check_differently_is_left_out_never_the_honest_peers(
    swarm, tmp_path
):
    """Stage 1 has two honest incumbents and is the stage checked (every micro-batch, `train.verify`
    1.0); stage 2 has an honest incumbent, and after step 1 a framer joins it. Once the stage-1
    peers see the framer they route everything to it (while it serves), so it serves both runs of
    every check and answers the second differently: compared by the stage-1 gradient digests alone
    (as at 21b579e), the two honest stage-1 peers disagree and the later admitted one was left out.
    The accounts name the first stage whose equal inputs gave other outputs, stage 2, where one peer
    served both runs: the framer alone is left out, every honest peer stays, and the losses are one
    process's."""
    cfg = smoke("model.num_stages=3", "train.verify=1.0")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 3), (2, 2)])
    honest_stage_2 = hosted[3].node.peer_id
    lied: list = []
    framer = []

    def join() -> None:
        framer.append(_framer(swarm, cfg, run_id, lied))
        swarm.loop.run(pipeline.router.peers(2, refresh=True))  # the trainer sees it at the next boundary
        for stage_1 in hosted[1:3]:  # everything goes to the framer while it serves
            choose = stage_1.handoff.choose

            async def to_framer(session, exclude=(), choose=choose):
                with contextlib.suppress(NoPeerError):  # (else, to whoever can take it)
                    return await choose(session, [*exclude, honest_stage_2])
                return await choose(session, exclude)

            stage_1.handoff.choose = to_framer

    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        verification = pipeline.dispatch.verification
        serving = verification.membership.serving
        verification._pick = lambda route: next(((1, p) for p in serving(1) if p != route[1]), None)  # stage 1 only
        results = AfterStep(1, join)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        framer_id = framer[0][0].peer_id
        assert lied, "the framer never answered a check"
        assert framer_id in pipeline.membership.convicted, pipeline.membership.convicted
        assert all(h.node.peer_id in pipeline.members[h.stage] for h in hosted), "an honest peer was left out"
        assert pipeline.membership.convicted == {framer_id}
        why = [e.text for e in pipeline.events.last() if e.kind == "leave" and framer_id[-8:] in e.text]
        assert why and "for the same inputs" in why[0], why
        print(
            f"\nthe framer lied on {len(lied)} checks; checks {verification.checks}, mismatches {verification.mismatches}"
        )
        local = [r["loss"] for r in local_rows(cfg, tmp_path, STEPS) if r["type"] == "step"]
        assert [r["loss"] for r in results.rows if r["type"] == "step"] == local
    finally:
        swarm.unhost(run_id)
        for node, server in framer:
            swarm.loop.run(server.stop())
            swarm.loop.run(node.shutdown())
