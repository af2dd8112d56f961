"""`train.schedule: async` over a swarm whose stage 1 has two peers, on real hivemind (loopback): the
oracle is one process's asynchronous run (swarm.engine.delay), within 1e-5 (replicas add their
gradients in another order)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import torch
from _swarm_env import local_rows, smoke

from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.stage.host import HostedStage

STEPS = 6
OVERRIDES = [
    "model.num_stages=3",
    "optimizer.grad_clip=0.05",  # binds at every step of this run: clipping is in the floats compared
    "compression.forward=topk:0.2",  # no state across micro-batches: the same floats on any pair of peers
    "compression.backward=topk:reuse",
    "train.schedule=async",
]


def _same_losses(rows, theirs) -> None:
    steps, reference = ([r for r in run if r["type"] == "step"] for run in (rows, theirs))
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for a, b in zip(steps, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["lr"] - b["lr"]) <= 1e-12 * b["lr"], (a["step"], a["lr"], b["lr"])
    evals, reference_evals = ([r["uncompressed"] for r in run if r["type"] == "eval"] for run in (rows, theirs))
    assert len(evals) == len(reference_evals) == 2
    for a, b in zip(evals, reference_evals, strict=True):
        assert all(abs(a[k] - v) <= 1e-5 * abs(v) for k, v in b.items()), (a, b)


def _identical(replicas) -> None:
    assert len(replicas) == 2
    pairs = zip(*(h.runtime.module.parameters() for h in replicas), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # each applied the same sum, once
    assert replicas[0].state.steps == replicas[1].state.steps == STEPS - 1  # the last step's is held


def _run(swarm, cfg, run_id: str, rows: ResultsWriter, snapshot_every: int = 0):
    data = build_data(cfg)
    pipeline = swarm.pipeline(cfg, run_id, STEPS, data, snapshot_every=snapshot_every)
    train(cfg, pipeline, data, rows, STEPS, progress=False)
    return pipeline


def test_two_peers_of_a_stage_sum_each_step_by_one_round_with_the_floats_of_one_process(swarm, tmp_path):
    """Stage 1 served by two peers from the start: each step closes by one round overlapped with
    the next step's micro-batches (each replica sums what it ran, the two sum those among
    themselves); the round also hands the step before's decision to a replica the micro-batches
    bringing it did not reach."""
    cfg = smoke(*OVERRIDES)
    reference = local_rows(cfg, tmp_path, STEPS)
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    try:
        rows = ResultsWriter(None)
        pipeline = _run(swarm, cfg, run_id, rows)
        _same_losses(rows.rows, reference)
        replicas = [h for h in hosted if h.stage == 1]
        assert all(h.meters.processed > 0 for h in replicas)  # both ran micro-batches: their sums are real sums
        _identical(replicas)
        notes = pipeline.summary_notes()
        assert notes["closed_on_the_way"] == 0 and notes["round_calls"]["gather"] == 4 * STEPS
        assert notes["round_bytes"].get("gather.received", 0) == 0  # no gradient through the trainer
        assert notes["overlapped_steps"] >= 3  # the rounds did not drain the pipeline
    finally:
        swarm.unhost(run_id)


def test_a_replica_killed_in_its_steps_round_sends_the_run_back_to_the_copies(swarm, tmp_path):
    """A replica dies inside the round of the first step after step 3 whose micro-batches it ran:
    their gradients cannot run again (the next step's moved the weights on), so nothing is applied,
    the run goes back to the swarm's copies (every 2 steps) and replays: one process's losses."""
    cfg = smoke(*OVERRIDES)
    reference = local_rows(cfg, tmp_path, STEPS)
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    node, server = swarm.mortal_host()
    mortal = server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.announcer.announce_now())
    killed = threading.Event()
    handle = mortal.rounds.handle

    async def dies_in_a_round(kind, head, payload):
        if kind == "gather" and head.held and head.step >= 3 and head.micro_batches and not killed.is_set():
            killed.set()
            threading.Thread(target=lambda: (swarm.loop.run(server.stop()), swarm.loop.run(node.shutdown()))).start()
            await asyncio.sleep(30)
        return await handle(kind, head, payload)

    mortal.rounds.handle = dies_in_a_round
    try:
        rows = ResultsWriter(None)
        pipeline = _run(swarm, cfg, run_id, rows, snapshot_every=2)
        assert killed.is_set() and node.peer_id not in pipeline.members[1]
        pauses = [(p["from_step"], p["to_step"]) for p in pipeline.recovery.history.pauses]
        assert len(pauses) == 1 and pauses[0][1] % 2 == 0 and pauses[0][1] <= pauses[0][0], pauses
        _same_losses(rows.rows, reference)
    finally:
        swarm.unhost(run_id)
