"""A stage served by one peer is checked too: the owner's verifier (`train.verifiers`, `python -m
peers.verifier`) serves the stage like a replica but is handed micro-batches only for the owner's
checks. Scripted on real hivemind (loopback)."""

from __future__ import annotations

import uuid

import pytest
import torch
from _swarm_env import AfterStep, local_rows, smoke

from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.transport.hivemind.stage.host import HostedStage

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 5


def _served(hosted: HostedStage, into: list) -> None:
    """Every training micro-batch `hosted` computes goes into `into`."""
    forward = hosted.work.forward

    def counted(batch, data, ends):
        if batch.mode.value == "train":
            into.append(batch.key)
        return forward(batch, data, ends)

    hosted.work.forward = counted


def test_a_stage_of_one_wrong_peer_is_caught_by_the_owners_verifier_which_takes_nothing_else(swarm, tmp_path):
    """Stage 1 has one routine peer and the owner's verifier; every micro-batch is checked
    (`train.verify` 1.0), each against the verifier. While the peer is honest the verifier computes
    exactly the checks' second runs (no routine micro-batch goes to it) and every check agrees.
    From step 3 on the peer computes with weights of its own (finite, well-formed, wrong): its first
    checked micro-batch convicts it, never the verifier, the verifier takes the stage's work from
    then on, and the losses are one process's."""
    node, server = swarm.mortal_host()
    cfg = smoke("model.num_stages=3", "train.verify=1.0", f'train.verifiers=["{node.peer_id}"]')
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    verifier = server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.announcer.announce_now())
    by_verifier: list = []
    _served(verifier, by_verifier)
    before: dict = {}
    wrong = hosted[1]

    def turn_wrong() -> None:
        before.update(served=len(by_verifier), checks=pipeline.dispatch.verification.checks)
        with torch.no_grad():
            next(wrong.runtime.module.parameters()).add_(1e-2)

    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        assert node.peer_id in pipeline.members[1]
        results = AfterStep(2, turn_wrong)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        verification = pipeline.dispatch.verification
        print(
            f"\nverifier: {before['served']} micro-batches for {before['checks']} checks over 2 steps"
            f" ({2 * cfg.train.micro_batches} routine micro-batches); {len(by_verifier)} in all;"
            f" checks {verification.checks}, mismatches {verification.mismatches}"
        )
        assert before["checks"] == 2 * cfg.train.micro_batches  # every micro-batch checked, all agreeing
        assert before["served"] == before["checks"], "the verifier took routine work"
        assert pipeline.membership.convicted == {wrong.node.peer_id}
        assert verification.mismatches == 1 and pipeline.members[1] == [node.peer_id]
        why = [e.text for e in pipeline.events.last() if e.kind == "leave" and wrong.node.peer_id[-8:] in e.text]
        assert why and "for the same inputs" in why[0], why
        local = [r["loss"] for r in local_rows(cfg, tmp_path, STEPS) if r["type"] == "step"]
        assert [r["loss"] for r in results.rows if r["type"] == "step"] == local
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())
