"""A swarm that loses a stage's last peer, or its trainer, and goes on from the copies it keeps of
every stage, on real hivemind (loopback). Every case ends with the losses of the single-process run."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
import uuid

import pytest
import torch
from _swarm_env import local_rows, smoke

from swarm.engine.checkpoint import read_stage
from swarm.training.experiment import build_data
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter
from swarm.transport.hivemind.dht.survey import format_table, survey
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.snapshots import Copy
from swarm.transport.hivemind.trainer.copies import Held, newest_complete
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline
from swarm.transport.hivemind.trust import manifests

STEPS = 12
EVERY = 3


def _cfg(forward: str = "topk:0.2", backward: str = "topk:reuse", *more: str):
    return smoke("model.num_stages=3", f"compression.forward={forward}", f"compression.backward={backward}", *more)


ASYNC = ("topk:0.2", "topk:reuse", "optimizer.grad_clip=0.05", "train.schedule=async")  # swarm.engine.delay
BOUNDARY_1 = ("compression.boundaries.1.forward=topk:0.3+aqsgd", "compression.boundaries.1.backward=lowrank:4+ef21")
LOOKAHEAD, DC = "train.delay_correction=lookahead", "train.delay_correction=dc:100000"


class _Hooked(ResultsWriter):
    """Results that call `hooks[n]()` right after step n's row (between two steps of the loop)."""

    def __init__(self, hooks) -> None:
        super().__init__(None)
        self.hooks = dict(hooks)

    def write(self, row) -> None:
        super().write(row)
        if row.get("type") == "step" and (hook := self.hooks.pop(row["step"], None)):
            hook()


class _Lossy:
    """Stages 0 and 2 on shared hosts 0 and 2, stage 1 only on a host of its own that a test kills."""

    def __init__(self, swarm, cfg=None) -> None:
        self.swarm, self.cfg, self.run_id = swarm, cfg or _cfg(), uuid.uuid4().hex[:8]
        self.hosted = swarm.host(self.cfg, self.run_id, [(0, 0), (2, 2)])
        self.node, self.server = swarm.mortal_host()
        self.mortal = self.server.host(HostedStage(self.node, self.run_id, self.cfg, 1))
        swarm.loop.run(self.server.announcer.announce_now())
        self.data = build_data(self.cfg)

    def pipeline(self) -> SwarmPipeline:
        pipeline = SwarmPipeline(self.swarm.trainer, self.swarm.loop, self.cfg, self.run_id, snapshot_every=EVERY)
        pipeline.setup(Schedule.of(self.cfg, len(self.data[0]), STEPS).lr_horizon, len(self.data[0]), wait_s=20)
        return pipeline

    def kill(self) -> None:
        self.swarm.loop.run(self.server.stop())
        self.swarm.loop.run(self.node.shutdown())

    def replace(self, after_s: float, index: int = 3) -> threading.Thread:
        """A new stage-1 peer on shared host `index`, `after_s` seconds from now."""

        def start() -> None:
            time.sleep(after_s)
            server = self.swarm.hosts[index][1]
            self.replacement = server.host(HostedStage(server.node, self.run_id, self.cfg, 1))
            self.swarm.loop.run(server.announcer.announce_now())

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.swarm.unhost(self.run_id)


def _same_losses(ours, theirs) -> None:
    steps = [r for r in ours if r["type"] == "step"]
    reference = [r for r in theirs if r["type"] == "step"]
    assert [r["step"] for r in steps] == [r["step"] for r in reference]  # each step once, in order
    for a, b in zip(steps, reference, strict=True):
        assert a["loss"] == b["loss"], a["step"]
        assert a["lr"] == pytest.approx(b["lr"])
    evals = [(r["step"], r["uncompressed"]["loss"]) for r in ours if r["type"] == "eval"]
    reference_evals = [(r["step"], r["uncompressed"]["loss"]) for r in theirs if r["type"] == "eval"]
    assert [s for s, _ in evals] == [s for s, _ in reference_evals]
    assert [v for _, v in evals] == pytest.approx([v for _, v in reference_evals], rel=1e-5)


class _TrainerDied(Exception):
    pass


def _until_the_trainer_dies(run, pipeline, at_step: int) -> _Hooked:
    """Trains until the trainer dies right after step `at_step`; the rows it wrote."""

    def die():
        raise _TrainerDied

    before = _Hooked({at_step: die})
    with pytest.raises(_TrainerDied):
        train(run.cfg, pipeline, run.data, before, STEPS, progress=False)
    return before


def _a_new_trainer_from_step_6(run, before: _Hooked, tmp_path) -> list[str]:
    """A new trainer of the run resumes it from the swarm's copies of step 6 and trains to the end
    with one process's losses (the dead one's rows up to step 6 kept); its stage-1 members."""
    swarm = run.swarm
    node = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))
    try:
        second = SwarmPipeline(node, swarm.loop, run.cfg, run.run_id, snapshot_every=EVERY)
        second.setup(Schedule.of(run.cfg, len(run.data[0]), STEPS).lr_horizon, len(run.data[0]), wait_s=20)
        members = list(second.members[1])
        assert second.resumed()["step"] == 6
        after = ResultsWriter(None)
        after.keep([r for r in before.rows if r["type"] == "config" or r.get("step", 0) <= 6])
        train(run.cfg, second, run.data, after, STEPS, progress=False)
        _same_losses(after.rows, local_rows(run.cfg, tmp_path, STEPS))
        return members
    finally:
        swarm.loop.run(node.shutdown())


def test_newest_complete_takes_the_newest_step_every_stage_has_a_copy_of():
    copies = [
        Held("a", 0, 0, 3, "L"),
        Held("a", 0, 0, 6, "L"),
        Held("b", 1, 0, 6, "L"),  # b holds stage 0's copy
        Held("b", 1, 1, 3, "L"),
        Held("c", 0, 1, 3, "L"),  # c (stage 0) holds stage 1's copy of step 3 only
        Held("x", 0, 0, 9, "M"),
        Held("x", 1, 1, 9, "M"),
    ]
    assert newest_complete(copies, 2, "L") == ("L", 3, {0: [("a", 0)], 1: [("b", 1), ("c", 0)]})
    assert newest_complete(copies, 2) == ("M", 9, {0: [("x", 0)], 1: [("x", 1)]})
    assert newest_complete(copies, 3) is None


def _kill_inside(run, obj, name: str, when) -> None:
    """`obj.name` (a coroutine function of the mortal stage-1 peer) kills its host when called with
    arguments `when` accepts, and never answers (a dead peer's reply does not go out); a new stage-1
    peer starts a second later."""
    original = getattr(obj, name)

    async def dying(*args):
        if when(*args):
            threading.Thread(target=run.kill, daemon=True).start()
            run.replace(1.0)
            await asyncio.sleep(30)
        return await original(*args)

    setattr(obj, name, dying)


def _wait(what, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("moment", "codecs", "back_to"),
    [
        ("at a micro-batch", "topk:0.2|topk:reuse", 6),
        ("as a step closes", "topk:0.2|topk:reuse", 6),
        ("during a snapshot", "topk:0.2|topk:reuse", 6),
        # between steps (the next micro-batch finds stage 1 gone), with error feedback: the copies
        # carry the link ends in use, so the new pairs go on from them
        # (boundary 0: the forward's subspace basis; boundary 1: AQ-SGD's and the low-rank
        # backward's mirrored state)
        ("between steps", "subspace:4|topk:0.1+ef21|" + "|".join(BOUNDARY_1), 6),
        # train.schedule async: the copies hold each stage's last step's gradients unapplied (the
        # loop drains before a copy); step 8's micro-batches were out when stage 1 died; and each
        # sender's low-rank warm start; a delay correction's weights (lookahead's move, dc's v_then)
        ("between steps", "|".join(["lowrank:4/warm", "lowrank:4/q8/warm+ef21", *ASYNC[2:], LOOKAHEAD]), 6),
        ("as a step closes", "|".join([*ASYNC, DC]), 6),  # step 7 applied (step 9's micro-batch brought it)
    ],
)
def test_the_last_peer_of_a_stage_killed_pauses_the_run_which_goes_on_from_the_copies(
    swarm, tmp_path, moment, codecs, back_to
):
    run = _Lossy(swarm, _cfg(*codecs.split("|")))
    try:
        pipeline = run.pipeline()
        hooks = {}
        if moment == "between steps":  # the next micro-batch finds stage 1 gone
            hooks[7] = lambda: (run.kill(), run.replace(2.0))
        elif moment == "at a micro-batch":  # the second micro-batch of step 8 is inside it
            _kill_inside(run, run.mortal.chain, "run", lambda head, *_: head.batch.step == 7 and head.batch.index == 1)
        elif moment == "as a step closes":  # step 8 is applied on the way (step 9's first micro-batch brought it)
            late = run.cfg.train.schedule == "async"  # a decision comes a step later
            _kill_inside(run, run.mortal.chain.closing, "decided", lambda decision: decision.step == 7 - late)
        else:  # step 9's copies are being taken: the newest complete ones are step 6's
            _kill_inside(run, run.mortal.snapshots, "snapshot", lambda head, _: head.step == 9 and not head.discard)
        results = _Hooked(hooks)
        train(run.cfg, pipeline, run.data, results, STEPS, progress=False)
        _same_losses(results.rows, local_rows(run.cfg, tmp_path, STEPS))
        [pause] = pipeline.recovery.history.pauses
        assert pause["to_step"] == back_to
        summary = next(r for r in results.rows if r["type"] == "summary")
        assert summary["pauses"] == [pause] and summary["copies"]["every"] == EVERY
        assert {int(s) for s in summary["copies"]["bytes"]} == {0, 1, 2} and summary["copies"]["rounds"] >= 4
        status = run.replacement.status()
        assert status.restores == 1 and status.restored_step == back_to and status.paused_s > 0.5
        held = lambda: {(c.stage, c.step) for c in run.replacement.status().snapshots}  # noqa: E731
        _wait("it holds stage 0's copies now, and its own", lambda: {(0, 9), (1, 9)} <= held())
        table = format_table(swarm.loop.run(survey(swarm.trainer, run.run_id)))
        row = next(line for line in table.splitlines() if run.replacement.node.peer_id[-8:] in line)
        assert f"went back to step {back_to} after a" in row and "(1x)" in row, table
        assert "copies: stage 0 step 9 (" in row and "stage 1 step 9 (" in row, table
        if "warm" in codecs:  # every copy's link ends carry their senders' warm starts
            _assert_copies_carry_warm_starts([*run.hosted, run.replacement])
    finally:
        run.close()


def _assert_copies_carry_warm_starts(hosts) -> None:
    saved = [read_stage(io.BytesIO(copy.payload)) for host in hosts for copy in host.snapshots.copies.values()]
    ends = [end for state in saved for end in (state["inbound"], state["outbound"]) if end is not None]
    assert len(ends) >= 4, len(ends)  # stages 0 and 2 one end each, stage 1 two, in each step's copies
    for end in ends:
        start = end["sender"]["basis"]
        assert start["kind"] == "lowrank-warm" and start["bases"], start


def test_a_new_trainer_takes_over_where_the_swarm_kept_copies(swarm, tmp_path):
    """A new trainer process finds the copies of step 6 and goes on from there. (Under async a new
    session makes the decision of the step the stages hold unapplied anew: test_async_swarm.py's
    checkpoint test; an asynchronous run back to its copies: the killed-stage cases above.)"""
    run = _Lossy(swarm)
    try:

        class TrainerDied(Exception):
            pass

        def die():
            raise TrainerDied

        first = run.pipeline()
        before = _Hooked({8: die})
        with pytest.raises(TrainerDied):
            train(run.cfg, first, run.data, before, STEPS, progress=False)
        node = swarm.loop.run(SwarmNode.create(swarm.options(client_mode=True)))  # a new trainer process
        try:
            second = SwarmPipeline(node, swarm.loop, run.cfg, run.run_id, snapshot_every=EVERY)
            second.setup(Schedule.of(run.cfg, len(run.data[0]), STEPS).lr_horizon, len(run.data[0]), wait_s=20)
            assert second.session != first.session and second.resumed()["step"] == 6
            assert second.recovery.lineage == first.recovery.lineage  # it carries on the first one's copies
            assert second.recovery.history.restarts == [{"to_step": 6}]
            after = ResultsWriter(None)
            after.keep([r for r in before.rows if r["type"] == "config" or r.get("step", 0) <= 6])
            train(run.cfg, second, run.data, after, STEPS, progress=False)
            _same_losses(after.rows, local_rows(run.cfg, tmp_path, STEPS))
            second.finish()  # the run is done: a later trainer starts afresh
            assert not any(h.snapshots.copies for h in [*run.hosted, run.mortal])
        finally:
            swarm.loop.run(node.shutdown())
    finally:
        run.close()


def test_a_negative_snapshot_interval_is_refused_in_one_line(capsys):
    from _util import SMOKE

    from peers.trainer import main

    assert main(["--config", str(SMOKE), "--snapshot_every", "-1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --snapshot_every must be 0 (no copies) or a positive number of steps, got -1"], lines


def test_a_holders_failed_fetch_is_reported_at_the_next_snapshot(swarm, caplog):
    run = _Lossy(swarm)
    try:
        holder = run.hosted[0].snapshots  # stage 0 holds the last stage's copies

        async def broken(stage, step, sources, accepted, weights, background=False):
            raise RuntimeError("the link broke")

        holder._download = broken
        pipeline = run.pipeline()
        with caplog.at_level(logging.WARNING, logger="swarm.transport.hivemind.trainer.recovery"):
            train(run.cfg, pipeline, run.data, ResultsWriter(None), 7, progress=False)
        assert (
            "the swarm holds no complete set of copies of step 3 away from their stages (the newest: none)"
            in caplog.text
        )
        assert (2, 3) not in holder.copies and (0, 3) in run.mortal.snapshots.copies  # stage 1 holds stage 0's
    finally:
        run.close()


def test_a_new_trainer_restores_only_copies_the_owners_manifest_names(swarm, tmp_path):
    """The trainer dies at step 8; before a new one starts, a peer announces stage 1 of the run
    showing copies of every stage at step 9 in the run's lineage (real copies of step 6, relabelled:
    any weights it likes). The new trainer restores only copies whose SHA-256 a manifest signed by
    the owner's key names: it goes back to step 6, and the losses are those of one process."""
    run = _Lossy(swarm)
    fake_node, fake_server = swarm.mortal_host()
    try:
        first = run.pipeline()
        before = _until_the_trainer_dies(run, first, at_step=8)
        fake = fake_server.host(HostedStage(fake_node, run.run_id, run.cfg, 1))
        fake.snapshots.lineage = first.recovery.lineage
        for hosted in [*run.hosted, run.mortal]:
            real = hosted.snapshots.copies[(hosted.stage, 6)]
            fake.snapshots.copies[(hosted.stage, 9)] = Copy(
                hosted.stage, 9, real.payload, real.codecs, sha256=real.sha256
            )
        swarm.loop.run(fake_server.announcer.announce_now())
        assert {(c.stage, c.step) for c in fake.status().snapshots} == {(0, 9), (1, 9), (2, 9)}
        assert all(m.step != 9 for m in run.mortal.status().manifests) and run.mortal.status().manifests
        second = _a_new_trainer_from_step_6(run, before, tmp_path)
        assert fake_node.peer_id in second  # an open run set it up: it announced stage 1
    finally:
        run.close()
        swarm.loop.run(fake_server.stop())
        swarm.loop.run(fake_node.shutdown())


def test_a_copy_of_weights_its_replicas_do_not_hold_is_never_restored(swarm, tmp_path):
    """Stage 1 has two peers; the second is hostile: its copies hold other weights, and it reports
    the digest its replica reports (so the owner's manifest names its copy). The stage-2 peer
    holding stage 1's copies fetches from it first; the trainer dies at step 8 and both stage-1
    peers with it. A new stage-1 peer restores from the holder, whose copy must be the honest one:
    the holder checked the digest inside the copy it fetched. The losses are those of one process."""
    run = _Lossy(swarm)
    hostile_node, hostile_server = swarm.mortal_host()
    try:
        hostile = hostile_server.host(HostedStage(hostile_node, run.run_id, run.cfg, 1))
        take = hostile.snapshots._take

        def forged(step: int, trainer: bytes) -> Copy:
            honest = take(step, trainer)
            saved = torch.load(io.BytesIO(honest.payload), weights_only=True)
            for tensor in saved["module"].values():
                tensor.add_(0.25)
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            payload = buffer.getvalue()
            return Copy(1, step, payload, honest.codecs, sha256=manifests.digest(payload), weights=honest.weights)

        hostile.snapshots._take = forged
        holder = run.hosted[1].snapshots  # stage 2 holds stage 1's copies
        fetch = holder._fetch
        first_hostile = lambda sources: sorted(sources, key=lambda peer: peer != hostile_node.peer_id)  # noqa: E731
        holder._fetch = lambda stage, step, sources, *checks: fetch(stage, step, first_hostile(sources), *checks)
        swarm.loop.run(hostile_server.announcer.announce_now())
        first = run.pipeline()
        assert set(first.members[1]) == {run.node.peer_id, hostile_node.peer_id}
        before = _until_the_trainer_dies(run, first, at_step=8)
        honest, forged_copy = run.mortal.snapshots.copies[(1, 6)], hostile.snapshots.copies[(1, 6)]
        assert honest.weights == forged_copy.weights  # replicas hold the same parameters and optimizer state
        assert forged_copy.sha256 in first.recovery.accepted[(first.recovery.lineage, 6)][1].copies  # it lied well
        assert holder.copies[(1, 6)].sha256 == honest.sha256  # the holder refused the forged copy
        run.kill()
        swarm.loop.run(hostile_server.stop())
        swarm.loop.run(hostile_node.shutdown())
        run.replace(0.0).join()
        assert _a_new_trainer_from_step_6(run, before, tmp_path) == [run.replacement.place.peer_id]
    finally:
        run.close()
