"""The last peer of a stage asked to leave (SIGTERM, Ctrl-C) after its run ended, on real
hivemind: with no run left to stop it leaves at once instead of waiting for another peer."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from _swarm_env import smoke, split_batches
from hivemind.utils.crypto import RSAPrivateKey

from swarm.training.experiment import build_data
from swarm.transport.hivemind.dht.runstatus import RunStatus, fetch_status, publish_status
from swarm.transport.hivemind.net.node import SwarmNode

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

WAITS = "no other peer serves this stage"


def _one_step(swarm):
    """A three-stage run on shared hosts 0..2, one step taken; its stages and pipeline."""
    cfg, run_id = smoke("model.num_stages=3"), uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    data = build_data(cfg)
    pipeline = swarm.pipeline(cfg, run_id, 1, data)
    pipeline.run_many(split_batches(cfg, data, 1)[0])
    pipeline.step()
    return run_id, hosted, pipeline


def _leave(swarm, said: list[str]) -> float:
    """Host 1 (stage 1's only peer) is asked to leave; how long it took."""
    began = time.monotonic()
    left = asyncio.run_coroutine_threadsafe(swarm.hosts[1][1].leave(said.append), swarm.loop.loop)
    try:
        left.result(timeout=15)
    finally:
        left.cancel()  # one that waits for another peer must not outlive its test on the shared loop
    return time.monotonic() - began


def test_the_last_peer_of_a_finished_run_leaves_at_once(swarm):
    run_id, hosted, pipeline = _one_step(swarm)
    # the trainer's status publisher, as peers/trainer.py runs it: a node signing with the owner's key
    owner = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True, signing_key=RSAPrivateKey.process_wide())))
    try:
        pipeline.finish()
        record = RunStatus(state=pipeline.state, trainer=swarm.trainer.peer_id)
        assert swarm.loop.run(publish_status(owner, run_id, record, ttl=60))
        status = swarm.loop.run(fetch_status(hosted[1].node, run_id, hosted[1].gate.owner))
        assert status is not None and status.state == "finished"  # signed by the owner the stage knows
        said = []
        assert _leave(swarm, said) < 5
        assert not any(WAITS in line for line in said) and "is finished; leaving now" in said[-1]
    finally:
        swarm.loop.run(owner.shutdown())
        swarm.unhost(run_id)


def test_the_last_peer_of_a_run_whose_trainer_is_gone_leaves_at_once(swarm):
    """No status record of its owner (the tests' trainer publishes none) and no micro-batch or step
    round for a record's lifetime: no trainer is left to stop."""
    run_id, hosted, _ = _one_step(swarm)
    try:
        quiet = swarm.trainer.settings.dht.record_ttl_s + 1  # as if the run went quiet that long ago
        hosted[1].rounds.last_s -= quiet
        hosted[1].meters.last_s -= quiet
        said = []
        assert _leave(swarm, said) < 5
        assert not any(WAITS in line for line in said) and "has no trainer" in said[-1]
    finally:
        swarm.unhost(run_id)
