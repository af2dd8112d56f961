"""Peers that join and leave a run mid-way, on real hivemind (loopback): a joiner downloads its
stage's state from a peer in service, follows the step rounds and takes work; peers die in the
middle of micro-batches, step rounds and downloads. Every case ends equal to the single-process run."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
from _joining_run import (
    STEPS,
    JoiningRun,
    close_to,
    forward_sent,
    route_only,
    same_weights,
    seen_ready,
    wait_until,
)

from swarm.transport.hivemind.dht.survey import format_table, survey

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def _held_back(source, release: threading.Event) -> None:
    """`source` takes its state when asked but sends it only once `release` is set (a slow link)."""
    serve = source.serve

    async def slow_serve():
        reply = await serve()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return reply

    source.serve = slow_serve


def test_a_joiner_downloads_the_state_replays_the_rounds_since_and_takes_work(swarm):
    run = JoiningRun(swarm, mortal=False)
    hosted, pipeline = run.hosted, run.pipeline
    try:
        release = threading.Event()
        _held_back(hosted[1].source, release)
        joiner = None
        for n in range(STEPS):
            if n == 1:
                joiner = run.join()
            if n == 4:  # its download of step 2's state arrives now: it replays steps 2 and 3
                assert joiner.role == "following" and joiner.state.steps == 0 and len(joiner.state.joining.kept) == 4
                release.set()
                wait_until("the joiner serves", lambda j=joiner: j.role == "serving")
                seen_ready(swarm, hosted[0].router, joiner.node.peer_id)
                route_only(hosted[0].router, joiner.node.peer_id, pipeline.members[1])
                hosted[0].handoff.sticky = None
            run.step(n)
            if n == 1:  # set up at the boundary after step 1: it follows the rounds from step 2 on
                assert pipeline.members[1] == [hosted[1].node.peer_id, joiner.node.peer_id]
                assert pipeline.following == {joiner.node.peer_id}
        assert joiner.state.joined is not None and joiner.state.joined[0] == 2 and joiner.state.joined[1] > 0
        assert joiner.meters.processed == run.cfg.train.micro_batches and joiner.state.steps == STEPS
        assert hosted[1].source.served == 1 and not pipeline.following
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert same_weights(joiner, hosted[1]) and close_to(joiner, run.local, 1)
        status = joiner.status()
        assert status.role == "serving" and status.state_bytes_in == joiner.state.joined[1] and status.joined_step == 2
        assert joiner.meters.first_batch_s > 0
        rows = {row.peer_id: row for row in swarm.loop.run(survey(swarm.trainer, run.run_id))}  # peers.status
        joined = rows[joiner.node.peer_id]
        assert joined.joining.joined_step == 2 and joined.work.role == "serving"
        assert rows[hosted[1].node.peer_id].joining.states_served == 1
        table = format_table(list(rows.values()))
        assert "serving, joined at step 2 (" in table and "gave its state 1x (" in table
    finally:
        run.close()


def test_the_first_peer_of_a_stage_killed_after_a_joiner_serves_the_run_goes_on(swarm):
    """The issue's trial: a stage-1 peer started after the trainer's setup, then the original one
    killed mid-step. The newcomer takes its micro-batches and the step's lost ones run again."""
    run = JoiningRun(swarm, shared_stage1=False)
    pipeline, original, micro_batches = run.pipeline, run.mortal, run.cfg.train.micro_batches
    try:
        run.step(0)
        joiner = run.join()
        run.step(1)
        wait_until("the joiner serves", lambda: joiner.role == "serving")
        items = run.steps[2]
        half = len(items) // 2
        ours = [m["loss"] for m in pipeline.run_many(items[:half])]  # through the original
        assert original.meters.processed == 2 * micro_batches + half
        sent, joiner_sent = pipeline.link_bytes(), forward_sent(joiner)
        run.kill()  # it dies holding this step's gradients
        ours += [m["loss"] for m in pipeline.run_many(items[half:])]
        assert ours == [m["loss"] for m in run.local.run_many(items)]
        assert pipeline.step() == pytest.approx(run.local.step())
        for n in range(3, STEPS):
            run.step(n)
        assert pipeline.members[1] == [joiner.node.peer_id]
        assert joiner.meters.processed == (STEPS - 2) * micro_batches  # the re-run ones included
        now = pipeline.link_bytes()  # what the dead peer sent before it died still counts
        key = "boundary1.forward.train"
        assert now[key] >= sent[key] + forward_sent(joiner) - joiner_sent > sent[key]
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert close_to(joiner, run.local, 1)
    finally:
        run.close()


def test_a_joiner_killed_while_it_follows_is_left_out(swarm):
    run = JoiningRun(swarm, mortal=False)
    hosted, pipeline = run.hosted, run.pipeline
    victim, victim_server = swarm.mortal_host()
    try:
        run.step(0)
        release = threading.Event()
        _held_back(hosted[1].source, release)  # its download is under way when it dies
        joiner = run.join(victim_server)
        run.step(1)
        assert victim.peer_id in pipeline.following and joiner.role == "following"
        swarm.loop.run(victim_server.stop())
        swarm.loop.run(victim.shutdown())
        for n in range(2, STEPS):
            run.step(n)
        assert pipeline.members[1] == [hosted[1].node.peer_id] and not pipeline.following
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert close_to(hosted[1], run.local, 1)
        release.set()
    finally:
        run.close()


def test_a_replica_killed_inside_the_step_rounds_is_left_out(swarm):
    """Two stage-1 peers serve from the start; one dies after the gradients were gathered, before
    the trainer sets their sum: the other applies it and the run goes on."""
    run = JoiningRun(swarm)
    hosted, pipeline = run.hosted, run.pipeline
    try:
        assert len(pipeline.members[1]) == 2
        route_only(hosted[0].router, run.node.peer_id, pipeline.members[1])
        run.step(0)
        gather = pipeline.rounds.gather

        def gather_then_die(wanted):
            grads = gather(wanted)
            run.kill()
            return grads

        pipeline.rounds.gather = gather_then_die
        run.step(1)
        pipeline.rounds.gather = gather
        hosted[0].router.bans.until.clear()
        for n in range(2, STEPS):
            run.step(n)
        assert pipeline.members[1] == [hosted[1].node.peer_id]
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert close_to(hosted[1], run.local, 1)
    finally:
        run.close()


def test_a_source_killed_during_the_download_and_a_busy_one_the_joiner_gets_its_state_elsewhere(swarm):
    run = JoiningRun(swarm)
    hosted, doomed = run.hosted, run.mortal
    try:
        run.step(0)
        hosted[1].source.busy = True  # serving another joiner: it refuses this one for now
        _held_back(doomed.source, threading.Event())  # takes the state, then dies sending it
        joiner = run.join()
        run.step(1)
        wait_until("the doomed source took its snapshot", lambda: doomed.source.busy)
        run.step(2)
        run.kill()
        hosted[1].source.busy = False
        wait_until("the joiner serves", lambda: joiner.role == "serving")
        for n in range(3, STEPS):
            run.step(n)
        assert run.node.peer_id not in run.pipeline.members[1] and hosted[1].source.served == 1
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert joiner.state.joined[0] >= 3 and same_weights(joiner, hosted[1]) and close_to(joiner, run.local, 1)
    finally:
        run.close()


def test_a_replica_killed_during_a_checkpoint_save_the_other_one_is_saved(swarm, tmp_path):
    run = JoiningRun(swarm)
    pipeline = run.pipeline
    try:
        run.step(0)
        pipeline.members[1].sort(key=lambda peer: peer != run.node.peer_id)  # the victim is asked first
        run.kill()
        pipeline.save_checkpoint(tmp_path, 1)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0.pt", "stage1.pt", "stage2.pt"]
        assert pipeline.members[1] == [run.hosted[1].node.peer_id]
        for n in range(1, STEPS):
            run.step(n)
    finally:
        run.close()


def test_a_replica_that_leaves_mid_step_finishes_what_it_holds_and_the_run_does_not_notice(swarm):
    run = JoiningRun(swarm)
    hosted, pipeline, leaving = run.hosted, run.pipeline, run.mortal
    try:
        route_only(hosted[0].router, run.node.peer_id, pipeline.members[1])  # micro-batches go to the leaver
        run.step(0)
        items, half = run.steps[1], len(run.steps[1]) // 2
        ours = [m["loss"] for m in pipeline.run_many(items[:half])]
        said = []
        left = asyncio.run_coroutine_threadsafe(run.server.leave(said.append), swarm.loop.loop)
        wait_until("it says it leaves", lambda: leaving.state.leaving)
        assert not left.done()  # it holds this step's gradients of its micro-batches
        hosted[0].router.bans.until.clear()
        ours += [m["loss"] for m in pipeline.run_many(items[half:])]  # refused there: the other replica
        assert ours == [m["loss"] for m in run.local.run_many(items)]
        assert pipeline.step() == pytest.approx(run.local.step())
        left.result(timeout=20)
        assert leaving.meters.processed == run.cfg.train.micro_batches + half and not leaving.runtime.held
        assert pipeline.members[1] == [hosted[1].node.peer_id]
        assert said and "leaving" in said[-1]
        run.kill()
        for n in range(2, STEPS):
            run.step(n)
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert close_to(hosted[1], run.local, 1)
    finally:
        run.close()


def test_the_last_peer_of_a_stage_waits_for_another_before_it_leaves(swarm):
    run = JoiningRun(swarm, mortal=False)
    hosted, pipeline = run.hosted, run.pipeline
    try:
        run.step(0)
        said = []
        left = asyncio.run_coroutine_threadsafe(swarm.hosts[1][1].leave(said.append), swarm.loop.loop)
        wait_until("it says it waits", lambda: said)
        assert "no other peer serves this stage" in said[0] and not hosted[1].state.leaving
        run.step(1)  # it keeps serving meanwhile
        joiner = run.join()
        run.step(2)
        wait_until("the joiner serves", lambda: joiner.role == "serving")
        wait_until("it sees the joiner and leaves", lambda: hosted[1].state.leaving)  # it looks every announce_every_s
        run.step(3)  # its apply reply tells the trainer it leaves (if step 2's did not already)
        left.result(timeout=30)
        assert pipeline.members[1] == [joiner.node.peer_id]
        run.step(4)
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert close_to(joiner, run.local, 1)
    finally:
        run.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_replica_killed_at_a_random_moment_while_another_joins_the_run_goes_on(swarm, seed):
    """Stage 1 has two peers and a third joins; one of the first two dies at a random moment of
    the steps that follow (a micro-batch, a step round, the joiner's download, or between)."""
    run = JoiningRun(swarm, steps=8)
    pipeline, local = run.pipeline, run.local
    try:
        run.step(0)
        joiner = run.join()
        rng = random.Random(seed)
        kill_at, delay = rng.randrange(1, 5), rng.uniform(0.0, 0.2)  # a step, and a moment in it
        killer = threading.Thread(target=lambda: (time.sleep(delay), run.kill()))
        try:
            for n, items in enumerate(run.steps[1:], start=1):
                if n == kill_at:
                    killer.start()
                ours = [m["loss"] for m in pipeline.run_many(items)]
                assert ours == [m["loss"] for m in local.run_many(items)]
                assert pipeline.step() == pytest.approx(local.step(), rel=1e-5)
        finally:
            if killer.is_alive():
                killer.join()
        assert pipeline.members[1] == [run.hosted[1].node.peer_id, joiner.node.peer_id]
        wait_until("the joiner serves", lambda: joiner.role == "serving")
        run.pipeline.settle()  # the last step may close on the way: applied when the next begins
        assert joiner.state.steps == 8 and same_weights(joiner, run.hosted[1]) and close_to(run.hosted[1], local, 1)
    finally:
        run.close()


def test_an_open_run_takes_joiners_within_its_admission_limits(swarm):
    """Two stage-1 peers announce themselves at once; with `joins_per_step` 1 the trainer sets one up
    at the next step boundary and the other at the one after (a flood of records costs the run one
    state download per stage and step), and every step keeps the single-process losses."""
    run = JoiningRun(swarm, mortal=False)
    settings = swarm.trainer.settings
    swarm.trainer.settings = dataclasses.replace(
        settings, limits=dataclasses.replace(settings.limits, joins_per_step=1)
    )
    try:
        pipeline, first = run.pipeline, run.hosted[1].node.peer_id
        run.step(0)
        joiners = [run.join(server=swarm.hosts[i][1]).node.peer_id for i in (3, 4)]
        run.step(1)  # set up at the boundary after step 1: one of them
        assert pipeline.members[1][0] == first and len(pipeline.members[1]) == 2
        assert pipeline.members[1][1] in joiners
        run.step(2)
        assert sorted(pipeline.members[1][1:]) == sorted(joiners)
        run.step(3)
    finally:
        swarm.trainer.settings = settings
        run.close()
