"""Members of an open run that do not play by the rules, scripted on real hivemind (loopback): each
run finishes, the hostile member is left out or refused and the trainer's events say why, and the
losses are those of the run without it (one process)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest
import torch
from _swarm_env import AfterStep, local_rows, smoke

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.errors import RemoteError
from protocols.message import Encoded, RawPart
from swarm.engine.microbatch import MicroBatch
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.net.calls import call
from swarm.transport.hivemind.net.meta import address, batch_to_meta, micro_batch_payload
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.stage.host import HostedStage

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 5


def _losses(rows) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows if r["type"] == "step"]


def _same_losses(ours, theirs) -> None:
    mine, reference = _losses(ours), _losses(theirs)
    assert [s for s, _ in mine] == [s for s, _ in reference] == list(range(1, len(reference) + 1))
    for (step, a), (_, b) in zip(mine, reference, strict=True):
        assert a == b, (step, a, b)


def _close(swarm, run_id: str, node, server) -> None:
    """The run's stages leave the shared hosts; the test's own host goes away."""
    swarm.unhost(run_id)
    swarm.loop.run(server.stop())
    swarm.loop.run(node.shutdown())


def test_an_asynchronous_step_with_a_check_holds_the_next_back_and_one_without_keeps_the_pipeline_full(swarm, tmp_path):
    """`train.verify` under an asynchronous schedule, with two honest peers on stage 1: the owner's
    draw (here fixed: micro-batch 1 of odd steps) decides which steps hold the next step's
    micro-batches back until their checks ran. A step after a step without checks enters while that
    step's micro-batches are out; one after a checked step never does; every check agrees, and the
    losses are one process's. Step 2 closes slowly: step 3's checks wait for it (they read step 3's
    routes, which the trainer keeps once step 2 is done)."""
    cfg = smoke("model.num_stages=3", "train.verify=0.5", "train.schedule=async", "train.delay_correction=lookahead")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 3), (2, 2)])
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        verification, checked = pipeline.dispatch.verification, set()

        def draw(items):
            step = items[0][0].step
            if step % 2:
                checked.add(step)
            return frozenset({1}) if step % 2 else frozenset()

        verification.draw = draw
        late_round = pipeline.closing.late_round

        async def slowly(step, grad_clip):  # step 3 (checked) ran while step 2 was still closing
            if step == 2:
                await asyncio.sleep(1.5)
            return await late_round(step, grad_clip)

        pipeline.closing.late_round = slowly
        check, seen = verification.check, []

        async def where(items, results, picks):  # the step the trainer's routes are of, at each check
            seen.append((items[0][0].step, pipeline.position.step_index))
            return await check(items, results, picks)

        verification.check = where
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        overlapped = pipeline.dispatch.overlapped
        assert verification.checks == len(checked) >= 2 and verification.mismatches == 0
        assert seen and all(step == position for step, position in seen), seen
        assert overlapped and not {step - 1 for step in overlapped} & checked, (overlapped, checked)
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.unhost(run_id)


def _a_stage_1_member_that_never_sums(swarm, cfg, run_id: str):
    """The issue's fake member: a stage-1 peer of its own host that answers every round with success
    but has no averaging handler and never joins its group's all-reduce; (node, server, its hosted
    stage, the groups it skipped)."""
    node, server = swarm.mortal_host()
    hostile = server.host(HostedStage(node, run_id, cfg, 1))
    swarm.loop.run(server.averager.stop())  # "protocols not supported" for anyone summing with it
    skipped = []

    async def never_sums(group, tensors, *rounds, **flags):  # any round of the group (a grid round too)
        skipped.append(group.group_id)
        return tensors

    hostile.rounds.combining.sum = never_sums
    swarm.loop.run(server.announcer.announce_now())
    return node, server, hostile, skipped


def test_a_member_that_answers_its_gather_but_never_sums_with_its_group_is_left_out(swarm, tmp_path):
    """A stage-1 member answers every round with success but has no averaging handler and never
    joins its group's all-reduce (the issue's fake member): its replica names it in GROUP_FAILED,
    the trainer leaves it out on that word (not on its info reply, which says it serves), its
    micro-batches run again on the replica, and the step completes."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    node, server, _, skipped = _a_stage_1_member_that_never_sums(swarm, cfg, run_id)
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        assert node.peer_id in pipeline.members[1]  # admitted, as an open run admits whoever announces
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert skipped, "the hostile member was never in a group"
        assert node.peer_id not in pipeline.members[1]
        why = [e.text for e in pipeline.events.last() if e.kind == "leave" and node.peer_id[-8:] in e.text]
        assert why and "averaging group failed on it" in why[0] and "answered the gather round with success" in why[0]
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        _close(swarm, run_id, node, server)


def test_a_member_the_owner_dropped_downloads_no_state_of_its_stage(swarm, tmp_path):
    """The issue's attacker, after the run above: the stage-1 member the open run admitted and the
    trainer then dropped (its averaging group failed on it) still holds its admission, the owner's
    signature. It asks the honest stage-1 peer for the stage's state (a joiner's download, weights
    and optimizer, and a copy's), bare and showing the last roster it was sent (which lists it):
    refused in one line, because the newer roster that peer holds no longer lists it, and not one
    byte of state is served to it."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    honest = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])[1]
    node, server, hostile, _ = _a_stage_1_member_that_never_sums(swarm, cfg, run_id)
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        assert node.peer_id in pipeline.members[1]
        train(cfg, pipeline, data, ResultsWriter(None), STEPS, progress=False)
        assert node.peer_id not in pipeline.members[1]
        session = honest.state.session_id  # the micro-batches since the drop brought the owner's word
        assert honest.gate.listed(1, honest.node.peer_id, session) and not honest.gate.listed(1, node.peer_id, session)
        assert hostile.gate.listed(1, node.peer_id, session)  # the older roster it shows lists it
        served = (honest.source.served, honest.source.bytes_out)
        bare = pb.StateRequest(to=address(run_id, 1), admission=hostile.gate.shown())
        shown = [hostile.gate.state_request(to=address(run_id, 1), snapshot=copy, stage=1) for copy in (False, True)]
        for request in [bare, *shown]:
            with pytest.raises(RemoteError, match="the owner's roster no longer has it serving stage 1") as refused:
                swarm.loop.run(call(node.streams, honest.node.peer_id, "state", request, b"", 30))
            assert "\n" not in str(refused.value)
        assert (honest.source.served, honest.source.bytes_out) == served
    finally:
        _close(swarm, run_id, node, server)


@pytest.mark.parametrize("finished", [True, False])
def test_a_member_replaying_a_real_micro_batch_index_never_counts(swarm, tmp_path, finished):
    """A stage-0 member re-sends stage 1 a micro-batch it sent a step earlier, relabelled with the
    current step and an index stage 1 just finished: stage 1 takes it (a member, at the step) and
    its gradients replace what was held for that index; or (`finished` False) it only starts it,
    with a link turn that never comes, so what stage 1 holds is nobody's while it waits. The
    gather names the attempt the trainer counted, stage 1 answers STALE for that index with the
    attempt it holds (or has under way) and its sender, the trainer, which never sent that attempt
    in this step, leaves the sender out for good and runs the micro-batch again, and the losses stay
    those of one process."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    node, server = swarm.mortal_host()
    server.host(HostedStage(node, run_id, cfg, 0))  # a second stage 0: the step closes by rounds
    swarm.loop.run(server.announcer.announce_now())
    middle = hosted[1]
    captured: dict[tuple[int, int], tuple[pb.MicroBatchHead, bytes]] = {}
    run = middle.chain.run

    async def capturing(head, payload, sender):
        if sender == node.peer_id:
            captured[(head.batch.step, head.batch.index)] = (head, bytes(payload))
        return await run(head, payload, sender)

    middle.chain.run = capturing
    replays, rerun, waiting = [], [], []
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        assert node.peer_id in pipeline.members[0]
        gather, run_again = pipeline.rounds._gather, pipeline.rounds.hooks.run_again

        async def replayed_first():
            step = pipeline.position.step_index
            earlier = sorted(k for k in captured if k[0] == step - 1)
            now = {i for i, route in pipeline.position.routes.items() if route[1] == middle.node.peer_id}
            if earlier and now and not replays:
                old_head, payload = captured[earlier[0]]
                head = pb.MicroBatchHead()
                head.CopyFrom(old_head)
                head.batch.step, head.batch.index = step, min(now)
                head.epoch, head.seq = time.time_ns(), 0 if finished else 5  # a link of its own
                head.ClearField("decision")
                sending = call(node.streams, middle.node.peer_id, "micro_batch", head, payload, 30)
                if finished:
                    replays.append((step, min(now), (await sending).head.kind))
                else:  # message 5 of a new link: it waits for messages 0-4, which never come
                    waiting.append(asyncio.ensure_future(sending))
                    replays.append((step, min(now), None))
                    await asyncio.sleep(0.5)
            await gather()

        async def counting(indices):
            rerun.append(list(indices))
            await run_again(indices)

        pipeline.rounds._gather = replayed_first
        pipeline.rounds.hooks.run_again = counting
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert replays and replays[0][2] == (pb.BACKWARD if finished else None), replays  # taken
        assert any(replays[0][1] in indices for indices in rerun), (replays, rerun)  # never counted: run again
        assert node.peer_id not in pipeline.members[0] and node.peer_id in pipeline.membership.convicted
        why = [e.text for e in pipeline.events.last() if e.kind == "leave" and node.peer_id[-8:] in e.text]
        assert why and "under an attempt the owner never made (a replay)" in why[0], why
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        for task in waiting:
            task.cancel()
        _close(swarm, run_id, node, server)


def test_a_members_absurd_budget_and_wrong_dtype_cost_it_not_the_run(swarm, tmp_path):
    """A member admitted to stage 0 (its key stolen, say) sends stage 1 micro-batches with a budget
    that is not a number or 1e308 seconds (answered as any other: a budget is capped at what any
    caller waits), then activations in float16, which no stage of this fp32 run sends: refused as
    malformed before any model sees them, and the sender banned. The run keeps its losses."""
    cfg = smoke("model.num_stages=3", "compression.backward=none")  # forward: TopK
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    rogue = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        middle = hosted[1].node.peer_id
        shape = (4, 8, 8, 8)  # the smoke model's stage-1 input: `width` channels of the 8x8 digit
        batch = MicroBatch(0, 0, torch.arange(4), torch.zeros(4, dtype=torch.long))

        def head(epoch: int, budget: float) -> pb.MicroBatchHead:
            made = pb.MicroBatchHead(
                to=address(run_id, 1), sender=rogue.peer_id, batch=batch_to_meta(batch), budget_s=budget, epoch=epoch
            )
            made.admission.CopyFrom(pipeline.owner.admit(pipeline.session, rogue.peer_id, 0))
            return made

        def payload(dtype) -> bytes:
            body = wire.encode(Encoded(shape, dtype, RawPart(torch.randn(shape).to(dtype).reshape(-1))))
            return micro_batch_payload(batch, body)

        for epoch, budget in ((1, float("nan")), (2, 1e308)):
            reply = swarm.loop.run(
                call(rogue.streams, middle, "micro_batch", head(epoch, budget), payload(torch.float32), 30)
            )
            assert reply.head.kind == pb.BACKWARD
        with pytest.raises(RemoteError, match="activations in float16: this run's stages send float32"):
            swarm.loop.run(call(rogue.streams, middle, "micro_batch", head(3, 5.0), payload(torch.float16), 10))
        with pytest.raises(RemoteError, match="banned") as caught:
            swarm.loop.run(call(rogue.streams, middle, "micro_batch", head(4, 5.0), payload(torch.float32), 10))
        assert caught.value.code == pb.REFUSED
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.unhost(run_id)
        swarm.loop.run(rogue.shutdown())


def test_a_member_that_stalls_its_micro_batches_costs_retries_not_the_run(swarm, tmp_path):
    """A stage-1 member takes micro-batches and never answers them (it answers everything else):
    each stalled micro-batch runs out of its budget, stage 0 stops routing to the member, the
    micro-batch runs again through the other stage-1 peer, and the losses stay one process's."""
    cfg = smoke("model.num_stages=3")
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    node, server = swarm.mortal_host()
    hostile = server.host(HostedStage(node, run_id, cfg, 1))
    stalled = []

    async def stalls(head, payload, sender):
        stalled.append((head.batch.step, head.batch.index))
        await asyncio.sleep(3600)

    hostile.chain.run = stalls
    swarm.loop.run(server.announcer.announce_now())
    settings = swarm.trainer.settings  # a micro-batch's budget: the trainer's call timeout
    swarm.trainer.settings = dataclasses.replace(
        settings, calls=dataclasses.replace(settings.calls, call_timeout_s=6.0)
    )
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        assert node.peer_id in pipeline.members[1]
        hosted[0].handoff.sticky = None
        hosted[0].router.bans.until.clear()
        hosted[0].router._random.seed(1)  # noqa: SLF001  its first choice among equals: the hostile member
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert stalled, "the hostile member was never routed to"
        assert hosted[0].router.bans.failures.get(node.peer_id, 0) >= 1  # stage 0 stopped routing to it
        said = [e.text for e in hosted[0].peer.events.last() if e.kind == "ban" and node.peer_id[-8:] in e.text]
        assert said and "not routed to for" in said[0], said  # what peers.status shows of stage 0
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        swarm.trainer.settings = settings
        _close(swarm, run_id, node, server)


@pytest.mark.parametrize(
    "schedule", [(), ("train.schedule=async", "train.delay_correction=dc:10")], ids=["sync", "async-dc"]
)
def test_a_member_computing_wrong_results_is_caught_by_verification_and_its_work_redone(swarm, tmp_path, schedule):
    """With `train.verify` 1.0 every micro-batch runs a second time through another peer of a
    replicated stage (stage 1: two honest peers, whose results always agree). A third joins after
    step 2 and, once it serves, computes with weights of its own (finite, well-formed, wrong). Its
    first micro-batches disagree with the incumbent's: it is on probation, so it is left out for good
    and says why, its micro-batches of that step run again, and the losses stay one process's. With
    an asynchronous schedule the checks run before the next step's micro-batches enter, so the wrong
    peer ran nothing of the next step when it is left out (one mismatch, not two)."""
    cfg = smoke("model.num_stages=3", "train.verify=1.0", *schedule)
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (1, 3), (2, 2)])  # two honest incumbents of stage 1
    node, server = swarm.mortal_host()
    wrong = []

    def join() -> None:
        hostile = server.host(HostedStage(node, run_id, cfg, 1))
        forward = hostile.work.forward

        def off(batch, data, ends):
            if not wrong:  # its own weights from its first micro-batch on
                with torch.no_grad():
                    next(hostile.runtime.module.parameters()).add_(1e-2)
            wrong.append(batch.key)
            return forward(batch, data, ends)

        hostile.work.forward = off
        swarm.loop.run(server.announcer.announce_now())
        swarm.loop.run(pipeline.router.peers(1, refresh=True))  # the trainer sees it at the next boundary

    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        results = AfterStep(1, join)
        train(cfg, pipeline, data, results, STEPS, progress=False)
        assert wrong, "the hostile member never computed"
        assert node.peer_id not in pipeline.members[1] and node.peer_id in pipeline.membership.convicted
        why = [e.text for e in pipeline.events.last() if e.kind == "leave" and node.peer_id[-8:] in e.text]
        assert why and "for the same inputs" in why[0], why
        verification = pipeline.dispatch.verification  # the honest peers' results always matched
        assert verification.mismatches == 1 and verification.checks > 2 * cfg.train.micro_batches
        summary = next(r for r in results.rows if r["type"] == "summary")
        assert summary["verified"] == {"checks": verification.checks, "mismatches": 1}
        assert all(h.node.peer_id in pipeline.members[h.stage] for h in hosted)
        _same_losses(results.rows, local_rows(cfg, tmp_path, STEPS))
    finally:
        _close(swarm, run_id, node, server)
