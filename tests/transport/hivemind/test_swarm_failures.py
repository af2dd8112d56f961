"""The swarm under stress, on real hivemind (loopback): micro-batches in flight, replicas, peers
that die or lose state, checkpoints. Each case ends equal to the single-process run."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch
from _swarm_env import assert_same_run, local_rows, smoke, split_batches

from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.hivemind.stage.host import HostedStage

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def test_a_killed_peer_is_banned_and_the_micro_batch_retried_on_another(swarm):
    """Stage 1 has two peers; the one serving dies mid-run; stage 0 retries on the other."""
    cfg = smoke("model.num_stages=3", "compression.forward=topk:0.2+ef21", "compression.backward=topk:reuse")
    run_id = uuid.uuid4().hex[:8]
    victim, victim_server = swarm.mortal_host()
    try:
        hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
        backup = hosted[1]
        doomed = victim_server.host(HostedStage(victim, run_id, cfg, 1))
        swarm.loop.run(victim_server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 4, data)
        assert len(pipeline.members[1]) == 2
        hosted[0].handoff.sticky = victim.peer_id  # make the victim the peer in use
        schedule = split_batches(cfg, data)
        for batch, x in schedule[0]:
            pipeline.run_many([(batch, x)])[0]
        pipeline.step()
        assert doomed.meters.processed == cfg.train.micro_batches and backup.meters.processed == 0
        swarm.loop.run(victim_server.stop())
        swarm.loop.run(victim.shutdown())
        losses = []
        for step in schedule[1:3]:
            losses += [pipeline.run_many([(batch, x)])[0]["loss"] for batch, x in step]
            pipeline.step()
        assert backup.meters.processed == 2 * cfg.train.micro_batches
        assert all(torch.isfinite(torch.tensor(losses)))
        assert victim.peer_id not in pipeline.members[1]
        assert hosted[0].router.bans.banned(victim.peer_id)
    finally:
        swarm.unhost(run_id)


def _reference(cfg, data, steps: int = 3):
    from swarm.transport.local import build_local_pipeline

    return build_local_pipeline(cfg, Schedule.of(cfg, len(data[0]), steps).lr_horizon, capacity=len(data[0]))[0]


def _only(router, keep: str, others) -> None:
    """Routes to `keep` alone (the others banned for now)."""
    router.bans.until = {peer: float("inf") for peer in others if peer != keep}


def test_micro_batches_overlap_in_the_pipeline(swarm, tmp_path):
    cfg = smoke(
        "model.num_stages=4",
        "compression.forward=topk:0.1+ef21",
        "compression.backward=topk:0.1+ef21",
        "train.micro_batches=8",
        "train.batch_size=32",
    )
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(s, s) for s in range(4)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, 3, progress=False)
    finally:
        swarm.unhost(run_id)
    assert pipeline.in_flight == 8
    assert max(h.meters.peak_queue for h in hosted) > 1  # a stage held several micro-batches at once
    assert_same_run(results.rows, local_rows(cfg, tmp_path, steps=3))


def test_replicas_of_a_stage_stay_identical_when_micro_batches_split_between_them(swarm):
    cfg = smoke("model.num_stages=3", "compression.forward=none", "compression.backward=none")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 4), (2, 2)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        local = _reference(cfg, data)
        replicas = [hosted[1], hosted[2]]
        ids = [h.node.peer_id for h in replicas]
        for items in split_batches(cfg, data):
            ours = []
            for i, (batch, x) in enumerate(items):
                _only(hosted[0].router, ids[i % 2], ids)
                hosted[0].handoff.sticky = None
                ours.append(pipeline.run_many([(batch, x)])[0]["loss"])
            assert ours == pytest.approx([m["loss"] for m in local.run_many(items)], rel=1e-6)
            assert pipeline.step() == pytest.approx(local.step())
        assert all(h.meters.processed == 6 for h in replicas)
        for p, q, r in zip(
            *(
                m.parameters()
                for m in (replicas[0].runtime.module, replicas[1].runtime.module, local.runtimes[1].module)
            ),
            strict=True,
        ):
            assert torch.equal(p, q)
            assert torch.allclose(p, r, rtol=1e-5, atol=1e-7)
    finally:
        swarm.unhost(run_id)


def test_a_peer_that_dies_holding_a_steps_gradients_has_them_recomputed(swarm):
    """Stage 1's serving peer dies after every micro-batch of a step went through it, before the
    step: the trainer re-runs those micro-batches on the other peer, and training stays exact."""
    cfg = smoke("model.num_stages=3", "compression.forward=none", "compression.backward=none")
    run_id = uuid.uuid4().hex[:8]
    victim, victim_server = swarm.mortal_host()
    try:
        hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
        doomed = victim_server.host(HostedStage(victim, run_id, cfg, 1))
        swarm.loop.run(victim_server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        local = _reference(cfg, data)
        ids = [victim.peer_id, hosted[1].node.peer_id]
        _only(hosted[0].router, victim.peer_id, ids)
        steps = split_batches(cfg, data)
        for n, items in enumerate(steps):
            ours = [m["loss"] for m in pipeline.run_many(items)]
            assert ours == pytest.approx([m["loss"] for m in local.run_many(items)], rel=1e-6)
            if n == 1:
                assert doomed.meters.processed == 2 * len(items) and hosted[1].meters.processed == 0
                swarm.loop.run(victim_server.stop())
                swarm.loop.run(victim.shutdown())
                hosted[0].router.bans.until.clear()
            assert pipeline.step() == pytest.approx(local.step())
        assert hosted[1].meters.processed == 2 * len(steps[0])  # step 1 re-run, then step 2
        assert victim.peer_id not in pipeline.members[1]
        pipeline.settle()  # the last step closed on the way: applied when the next begins
        for p, r in zip(hosted[1].runtime.module.parameters(), local.runtimes[1].module.parameters(), strict=True):
            assert torch.allclose(p, r, rtol=1e-5, atol=1e-7)
    finally:
        swarm.unhost(run_id)


def test_a_link_whose_receiver_lost_its_state_restarts_on_both_ends(swarm):
    cfg = smoke("model.num_stages=2", "compression.forward=topk:0.2+ef21", "compression.backward=topk:0.2+ef21")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 3, data)
        steps = split_batches(cfg, data)
        receiver = hosted[1].node.peer_id
        pipeline.run_many(steps[0])
        pipeline.step()
        epoch = hosted[0].links.numbering.epoch(receiver)

        hosted[
            1
        ].chain.link_grace = (
            3.0  # as if stage 1 restarted: it knows nothing of the link (a grace a loaded machine meets)
        )
        hosted[1].links.turnstiles.clear()
        hosted[1].links.ends_in.clear()
        losses = [m["loss"] for m in pipeline.run_many(steps[1])]
        pipeline.step()
        assert all(torch.isfinite(torch.tensor(losses)))
        assert hosted[0].links.numbering.epoch(receiver) > epoch
        epoch = hosted[0].links.numbering.epoch(receiver)

        table = hosted[1].links.ends_in[hosted[0].node.peer_id].receiver.table  # its mirrored state moves on alone
        table._buffers = {shape: (buf, version + 7) for shape, (buf, version) in table._buffers.items()}
        losses = [m["loss"] for m in pipeline.run_many(steps[2])]
        pipeline.step()
        assert all(torch.isfinite(torch.tensor(losses)))
        assert hosted[0].links.numbering.epoch(receiver) > epoch
    finally:
        swarm.unhost(run_id)


def test_swarm_checkpoint_resumes_exactly_in_the_swarm_and_in_one_process(swarm, tmp_path):
    """Checkpoints every 2 steps of 4; the last one is lost, as if the trainer died after step 3.
    A new trainer session resumes the swarm from step 2, and a single-process run resumes the same
    files: both repeat the uninterrupted run, error-feedback state included."""
    import shutil

    from swarm.training.checkpoints import Checkpointing

    cfg = smoke(
        "model.num_stages=3",
        "compression.forward=topk:0.2+ef21",
        "compression.backward=topk:0.2+ef21",
        "train.eval_every=100",
    )
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    directory = tmp_path / "ckpt"
    try:
        data = build_data(cfg)
        first = ResultsWriter(None)
        train(
            cfg,
            swarm.pipeline(cfg, run_id, 4, data),
            data,
            first,
            4,
            progress=False,
            checkpoint=Checkpointing(str(directory), 2),
        )
        assert sorted(p.name for p in directory.iterdir()) == ["step-00000002", "step-00000004"]
        assert sorted(p.name for p in (directory / "step-00000002").iterdir()) == [
            "experiment.json",
            "stage0.pt",
            "stage1.pt",
            "stage2.pt",
            "trainer.pt",
        ]
        shutil.rmtree(directory / "step-00000004")
        resumed = ResultsWriter(None)
        train(
            cfg,
            swarm.pipeline(cfg, run_id, 4, data),
            data,
            resumed,
            4,
            progress=False,
            checkpoint=Checkpointing(str(directory), 2),
        )
    finally:
        swarm.unhost(run_id)
    uninterrupted = local_rows(cfg, tmp_path, steps=4)
    reference = [r["loss"] for r in uninterrupted if r["type"] == "step"]
    losses = [r["loss"] for r in first.rows if r["type"] == "step"]
    assert losses == pytest.approx(reference, rel=1e-5)
    after = [r["loss"] for r in resumed.rows if r["type"] == "step"]
    assert [r["step"] for r in resumed.rows if r["type"] == "step"] == [3, 4]
    assert after == pytest.approx(reference[2:], rel=1e-5)
    shutil.rmtree(directory / "step-00000004")
    local = tmp_path / "local.jsonl"
    run_experiment(cfg, local, 4, progress=False, checkpoint=Checkpointing(str(directory), 2))
    assert [r["loss"] for r in read_results(local) if r["type"] == "step"] == pytest.approx(reference[2:], rel=1e-5)


def test_a_lookup_that_finds_nobody_keeps_the_last_answer_for_a_while(swarm):
    """Over a saturated slow link the DHT's requests can time out while the peers serve on (seen at
    10 Mbit/s): the router keeps the last peers it found for `keep_s`, then gives up."""
    import time

    from swarm.transport.hivemind.dht.announce import StageRecord, announce
    from swarm.transport.hivemind.routing.router import NoPeerError, Router

    run_id = uuid.uuid4().hex[:8]
    node = swarm.hosts[0][0]
    record = StageRecord(node.peer_id, 1, 4, [], ready=True)
    assert swarm.loop.run(announce(node, run_id, record, ttl=1.5))
    keeping, forgetting = (
        Router(swarm.trainer, run_id, refresh_s=0.0),
        Router(swarm.trainer, run_id, refresh_s=0.0, keep_s=0.0),
    )
    for router in (keeping, forgetting):
        assert swarm.loop.run(router.choose(1)).peer_id == node.peer_id
    time.sleep(2.0)  # the record expired: the DHT has nobody for stage 1
    assert swarm.loop.run(keeping.choose(1)).peer_id == node.peer_id
    with pytest.raises(NoPeerError, match="no live peer serves stage 1"):
        swarm.loop.run(forgetting.choose(1))
    keeping.keep_s = 0.0
    with pytest.raises(NoPeerError):
        swarm.loop.run(keeping.choose(1))


def test_a_ban_steers_to_a_stages_other_peer_and_a_stages_only_peer_is_tried_again(swarm):
    """A failed peer is banned: the router chooses the stage's other peer. With every peer of the
    stage banned it chooses the one whose ban ends first, not NoPeerError (a lab run died at step 0
    when one dial from stage 0 to stage 1's only peer failed: stage 0 then refused every micro-batch
    with "no live peer serves stage 1"). Only peers excluded by the caller are never chosen."""
    from swarm.transport.hivemind.dht.announce import StageRecord, announce
    from swarm.transport.hivemind.routing.router import NoPeerError, Router

    run_id = uuid.uuid4().hex[:8]
    first, second = swarm.hosts[0][0], swarm.hosts[1][0]
    for node in (first, second):
        assert swarm.loop.run(announce(node, run_id, StageRecord(node.peer_id, 1, 4, [], ready=True), ttl=30))
    router = Router(swarm.trainer, run_id, refresh_s=0.0)
    router.failed(first.peer_id)
    assert {swarm.loop.run(router.choose(1)).peer_id for _ in range(5)} == {second.peer_id}
    router.failed(second.peer_id)  # both banned; the first's ban ends first
    assert swarm.loop.run(router.choose(1)).peer_id == first.peer_id
    assert swarm.loop.run(router.choose(1, exclude={first.peer_id})).peer_id == second.peer_id
    with pytest.raises(NoPeerError, match="no live peer serves stage 1"):
        swarm.loop.run(router.choose(1, exclude={first.peer_id, second.peer_id}))


def test_a_micro_batch_sent_again_while_its_first_attempt_is_still_downstream_supersedes_it(swarm):
    """Stage 1's peer dies while its micro-batch sits at stage 3; stage 0 sends it again through the
    other stage-1 peer, so stage 2 gets it twice. The old attempt's reply comes back first: it must
    not take the new attempt's forward state (that would fail the new one's backward)."""
    cfg = smoke("compression.forward=topk:0.2", "compression.backward=topk:reuse")  # 4 stages
    run_id = uuid.uuid4().hex[:8]
    victim, victim_server = swarm.mortal_host()
    try:
        hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2), (3, 3)])
        victim_server.host(HostedStage(victim, run_id, cfg, 1))
        swarm.loop.run(victim_server.announcer.announce_now())
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 2, data)
        local = _reference(cfg, data, 2)
        _only(hosted[0].router, victim.peer_id, pipeline.members[1])
        last = hosted[3]
        run3, calls = last.chain.run, []
        first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

        async def ordered(head, payload, sender):
            calls.append(sender)
            if len(calls) == 1:  # the first attempt waits here until the second one arrives
                first_in.set()
                while not second_in.is_set():
                    await asyncio.sleep(0.01)
                try:
                    return await run3(head, payload, sender)
                finally:
                    first_out.set()
            second_in.set()  # the second waits until stage 2 had the first one's reply
            while not first_out.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            return await run3(head, payload, sender)

        last.chain.run = ordered
        (items,) = split_batches(cfg, data, 1)
        batch, x = items[0]
        result = {}

        def send() -> None:
            try:
                result.update(pipeline.run_many([(batch, x)])[0])
            except Exception as e:
                result["error"] = e

        sender = threading.Thread(target=send)
        sender.start()
        assert first_in.wait(20)
        hosted[0].router.bans.until.pop(hosted[1].node.peer_id)  # the other stage-1 peer may serve again
        swarm.loop.run(victim_server.stop())
        swarm.loop.run(victim.shutdown())
        sender.join(60)
        assert "error" not in result, result
        assert result["loss"] == pytest.approx(local.run_many([(batch, x)])[0]["loss"], rel=1e-6)
        assert len(calls) >= 2 and not hosted[2].runtime.pending
        last.chain.run = run3
        ours = [m["loss"] for m in pipeline.run_many(items[1:])]
        assert ours == pytest.approx([m["loss"] for m in local.run_many(items[1:])], rel=1e-6)
        assert pipeline.step() == pytest.approx(local.step())
    finally:
        swarm.unhost(run_id)


def test_a_trainer_waits_past_a_stages_stale_record_for_a_live_peer(swarm):
    """Stage 1's only record is of a peer that is gone (its record outlives it until it expires):
    the trainer's setup leaves it out and waits for a live peer of the stage, instead of ending the
    run at its start."""
    from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline

    cfg, run_id = smoke("model.num_stages=2"), uuid.uuid4().hex[:8]
    node, server = swarm.mortal_host()
    server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.announcer.announce_now())
    swarm.host(cfg, run_id, [(0, 0)])
    gone = node.peer_id
    swarm.loop.run(server.stop())
    swarm.loop.run(node.shutdown())
    data = build_data(cfg)
    pipeline = SwarmPipeline(swarm.trainer, swarm.loop, cfg, run_id)
    assert [r.peer_id for r in swarm.loop.run(pipeline.router.peers(1, refresh=True))] == [gone]
    later = threading.Timer(2.0, lambda: swarm.host(cfg, run_id, [(1, 1)]))  # a live peer comes
    later.start()
    try:
        members = pipeline.setup(Schedule.of(cfg, len(data[0]), 2).lr_horizon, len(data[0]), wait_s=30)
        assert members == {0: [swarm.hosts[0][0].peer_id], 1: [swarm.hosts[1][0].peer_id]}
    finally:
        later.join()
        swarm.unhost(run_id)
