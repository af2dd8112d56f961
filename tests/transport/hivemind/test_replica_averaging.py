"""Replicas of a stage sum their gradients among themselves over hivemind's all-reduce, and so do the
two stages of a tied parameter: the trainer's step rounds carry no gradients. On real hivemind
(loopback), each run checked against the single-process run."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch
from _swarm_env import local_rows, smoke, tiny_gpt2

from swarm.engine.exactsum import FIRST_EXPONENT, pack_grid, unpack_grid
from swarm.engine.microbatch import Mode
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.replicasum import GRID_ROUND, REDO
from swarm.transport.hivemind.trainer.membership import Position
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 8


def _same_losses(ours, theirs) -> None:
    steps = [r for r in ours if r["type"] == "step"]
    reference = [r for r in theirs if r["type"] == "step"]
    assert [r["step"] for r in steps] == [r["step"] for r in reference]
    for a, b in zip(steps, reference, strict=True):
        assert a["loss"] == b["loss"], a["step"]  # bit for bit, however the replicas split a step


def _train(
    swarm, cfg, run_id: str, results: ResultsWriter, steps: int = STEPS, every: int = 0, made: list | None = None
) -> SwarmPipeline:
    """`made` gets the pipeline before it trains (for a test's thread to watch it)."""
    data = build_data(cfg)
    pipeline = SwarmPipeline(swarm.trainer, swarm.loop, cfg, run_id, snapshot_every=every)
    if made is not None:
        made.append(pipeline)
    pipeline.setup(Schedule.of(cfg, len(data[0]), steps).lr_horizon, len(data[0]), wait_s=20)
    train(cfg, pipeline, data, results, steps, progress=False)
    return pipeline


def _no_gradients_through_the_trainer(pipeline: SwarmPipeline) -> None:
    sent = pipeline.rounds.payload_bytes
    assert sent["gather.received"] == 0 and sent["set_grads.sent"] == 0, dict(sent)
    assert sent["gather.sent"] == 0 and sent["apply.sent"] == 0


def _rounds_summed(hosted: list[HostedStage]) -> list[bytes]:
    """The rounds (id suffixes, stage.replicasum) that `hosted` sum with their groups, as they go."""
    rounds = []
    for h in hosted:
        combining = h.rounds.combining

        async def sum_and_note(group, tensors, round_id=b"", integers=(), sum=combining.sum):
            if not group.names:  # a replicas' group
                rounds.append(round_id)
            return await sum(group, tensors, round_id, integers)

        combining.sum = sum_and_note
    return rounds


def test_replicas_sum_among_themselves_and_one_killed_mid_run_leaves_the_others_exact(swarm, tmp_path):
    cfg = smoke("model.num_stages=3", "compression.forward=topk:0.2", "compression.backward=topk:reuse")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    node, server = swarm.mortal_host()
    mortal = server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.announcer.announce_now())
    killed = threading.Event()
    gather = mortal.rounds.handle

    async def dies_in_step_5(kind, head, payload):  # inside the all-reduce of step 5's gather round
        if kind == "gather" and head.step == 4 and not killed.is_set():
            killed.set()
            threading.Thread(target=lambda: (swarm.loop.run(server.stop()), swarm.loop.run(node.shutdown()))).start()
            await asyncio.sleep(30)
        return await gather(kind, head, payload)

    mortal.rounds.handle = dies_in_step_5
    rounds = _rounds_summed([h for h in [*hosted, mortal] if h.stage == 1])
    try:
        results = ResultsWriter(None)
        pipeline = _train(swarm, cfg, run_id, results)
        assert killed.is_set() and mortal.node.peer_id not in pipeline.members[1]
        # every step's sum on the grid the trainer sent: no round of their own to agree on one
        assert len(rounds) >= STEPS and set(rounds) == {b""}, rounds
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
        _no_gradients_through_the_trainer(pipeline)
        replicas = [h for h in hosted if h.stage == 1]
        assert all(h.meters.processed > 0 for h in replicas)  # both took micro-batches: their sums are real sums
        for a, b in zip(*(h.runtime.module.parameters() for h in replicas), strict=True):
            assert torch.equal(a, b)  # every replica holds the same sum, bit for bit
    finally:
        swarm.unhost(run_id)


def test_a_replica_holding_stale_gradients_refuses_its_group_so_the_round_reruns_at_once(swarm, tmp_path):
    """At step 3's gather one stage-1 replica finds a micro-batch's gradients stale (as when the same
    attempt finished there twice: stage.attempts) and answers STALE. It refuses its averaging group,
    so the other replica's sum fails on that word, not after the all-reduce's timeout (in a lab run
    the leaving replica waited out its 120 s there); the trainer runs the micro-batch again, both
    replicas stay, and the losses are one process's."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    stale, other = (h for h in hosted if h.stage == 1)
    handle_stale, handle_other = stale.rounds.handle, other.rounds.handle
    marked, failures = [], []

    async def finds_one_stale(kind, head, payload):
        if kind == "gather" and head.step == 3 and head.micro_batches and not marked:
            key = (Mode.TRAIN.value, 3, min(head.micro_batches))
            marked.append(key)
            stale.state.attempts._held[key] = (b"", "")  # what a second finish of one attempt leaves
        return await handle_stale(kind, head, payload)

    async def records_failures(kind, head, payload):
        try:
            return await handle_other(kind, head, payload)
        except Exception as e:
            failures.append((kind, head.step, str(e)))
            raise

    stale.rounds.handle, other.rounds.handle = finds_one_stale, records_failures
    try:
        results = ResultsWriter(None)
        pipeline = _train(swarm, cfg, run_id, results, steps=5)
        assert marked, "stage 1's replica never gathered micro-batches at step 3"
        assert [(kind, step) for kind, step, _ in failures] == [("gather", 3)], failures
        # the refusal as the other replica sees it: the word, or (when the stale one leaves the
        # exact sum's grid round, swarm.engine.exactsum, before sending) its parts missing at once
        refused = ("refused the group", "BAD_GROUP_ID", "sent 0 parts")
        assert any(word in failures[0][2] for word in refused), failures
        assert "no result within" not in failures[0][2]
        assert {h.node.peer_id for h in (stale, other)} == set(pipeline.members[1])
        _same_losses(results.rows, local_rows(cfg, tmp_path, 5))
    finally:
        swarm.unhost(run_id)


def test_a_grid_that_is_not_the_steps_is_found_in_the_sum_and_redone_exactly(swarm, tmp_path, monkeypatch):
    """At step 2 the trainer hands stage 1's replicas a grid one exponent too coarse (as a report of
    other gradients than those summed would): their check in the integers' all-reduce finds it, they
    agree on the step's grid in a round of their own and sum again, and the losses stay one process's."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    rounds = _rounds_summed([h for h in hosted if h.stage == 1])
    merged = Position.grid

    def coarser_at_step_2(position, stage):
        grid = merged(position, stage)
        if position.step_index != 2 or stage != 1 or not grid:
            return grid
        size = len(grid) // 4
        codes, counts = unpack_grid(grid, size)
        return pack_grid([c + 1 if c >= FIRST_EXPONENT else c for c in codes], counts)

    monkeypatch.setattr(Position, "grid", coarser_at_step_2)
    try:
        results = ResultsWriter(None)
        _train(swarm, cfg, run_id, results, steps=4)
        # both replicas, once: step 2's sum on the grid given, the grid round, the sum again
        assert rounds.count(GRID_ROUND) == rounds.count(REDO) == 2 and len(rounds) == 2 * (4 + 2), rounds
        _same_losses(results.rows, local_rows(cfg, tmp_path, 4))
    finally:
        swarm.unhost(run_id)


def test_tied_weights_and_clipping_with_replicas_on_both_tied_stages(swarm, tmp_path):
    cfg = tiny_gpt2(tmp_path)
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (0, 3), (1, 1), (2, 2), (2, 4)])
    try:
        results = ResultsWriter(None)
        pipeline = _train(swarm, cfg, run_id, results, steps=6)
        _same_losses(results.rows, local_rows(cfg, tmp_path, 6))
        _no_gradients_through_the_trainer(pipeline)
        copies = [h.runtime.module.get_parameter("wte.weight") for h in hosted if h.stage == 0]
        copies += [h.runtime.module.get_parameter("lm_head.weight") for h in hosted if h.stage == 2]
        assert all(torch.equal(copies[0], c) for c in copies[1:])  # both replicas of both tied copies
    finally:
        swarm.unhost(run_id)


def test_a_lost_stage_with_replicas_and_tied_weights_elsewhere_goes_back_and_replays_exactly(swarm, tmp_path):
    """Stage 1's only peer dies after step 5; the replicas of stages 0 and 2 and their tied groups
    go back to the copies of step 4 with the others and replay: new averaging groups every time."""
    cfg = tiny_gpt2(tmp_path)
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (0, 3), (2, 2), (2, 4)])
    node, server = swarm.mortal_host()
    server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.announcer.announce_now())

    made: list[SwarmPipeline] = []

    def kill_and_replace() -> None:
        swarm.loop.run(server.stop())
        swarm.loop.run(node.shutdown())

        def replace() -> None:
            # once the trainer has found stage 1 empty and paused: a replacement there sooner could
            # be routed to without a pause (the deadline only bounds a failure)
            deadline = time.monotonic() + 60
            while made[0].recovery.paused is None and time.monotonic() < deadline:
                time.sleep(0.05)
            swarm.host(cfg, run_id, [(1, 1)])

        threading.Thread(target=replace, daemon=True).start()

    class Hooked(ResultsWriter):
        def write(self, row) -> None:
            super().write(row)
            if row.get("type") == "step" and row["step"] == 5 and not getattr(self, "done", False):
                self.done = True
                kill_and_replace()

    try:
        results = Hooked(None)
        pipeline = _train(swarm, cfg, run_id, results, steps=8, every=2, made=made)
        assert [(p["from_step"], p["to_step"]) for p in pipeline.recovery.history.pauses] == [(5, 4)]
        _same_losses(results.rows, local_rows(cfg, tmp_path, 8))
    finally:
        swarm.unhost(run_id)
