"""`train.schedule: async` over a swarm on real hivemind (loopback, never mocked), on the session's
shared swarm: the oracle is one process's asynchronous run (swarm.engine.delay)."""

from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest
import torch
from _swarm_env import assert_close_losses, forwards_at_kept_weights, local_rows, smoke, step_losses, swarm_rows

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError
from swarm.engine.microbatch import Mode
from swarm.training.checkpoints import Checkpointing, run_dir
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import train
from swarm.training.results import ResultsWriter, read_results

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

OVERRIDES = [
    "model.num_stages=4",
    "optimizer.grad_clip=0.05",
    "compression.forward=quant:4+ef",
    "compression.backward=quant:4",
    "train.schedule=async",
]


def _assert_one_process(rows, theirs) -> list[float]:
    """`rows`, a swarm's asynchronous run of 6 steps, are one process's `theirs` (losses within 1e-5,
    learning rates, evaluations, bytes), every step closed on the way and most of them overlapped;
    its losses."""
    steps, reference = ([r for r in run if r["type"] == "step"] for run in (rows, theirs))
    assert len(steps) == len(reference) == 6
    for a, b in zip(steps, reference, strict=True):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"])
    evals, reference_evals = ([r["uncompressed"] for r in run if r["type"] == "eval"] for run in (rows, theirs))
    assert len(evals) == len(reference_evals) == 2  # at step 5 (the pipeline drains first) and at the end
    for a, b in zip(evals, reference_evals, strict=True):
        assert a == b
    summary, their_summary = rows[-1], theirs[-1]
    assert summary["bytes"] == their_summary["bytes"]  # a step's row may count bytes of the next one's
    assert summary["closed_on_the_way"] == summary["steps"] == 6 and summary["round_calls"] == {}
    # a draining schedule overlaps none; how many of steps 1..4 do depends on the load (step 5 follows an evaluation)
    assert summary["overlapped_steps"] >= 1
    return [r["loss"] for r in reference]


def test_an_asynchronous_schedule_overlaps_steps_with_the_floats_of_one_process(swarm, tmp_path):
    """train.schedule async (swarm.engine.delay): the next step's micro-batches enter while a step's
    are in flight, each stage applies step t's gradients when step t + 2's first micro-batch comes
    and stashes the weights step t + 1's pending backward needs. The losses, learning rates and
    evaluations of one process's asynchronous run, which are not its synchronous run's."""
    cfg = smoke(*OVERRIDES)
    reference = _assert_one_process(swarm_rows(swarm, cfg, steps=6), local_rows(cfg, tmp_path, steps=6))
    synchronous = [r["loss"] for r in local_rows(smoke(*OVERRIDES[:-1]), tmp_path, steps=6) if r["type"] == "step"]
    assert synchronous[0] == reference[0]  # the same first step; then one step late
    assert all(loss != r for loss, r in zip(synchronous[1:], reference[1:], strict=True))


def test_delay_corrections_run_in_a_swarm_with_the_floats_of_one_process(swarm, tmp_path):
    """lookahead (each step's micro-batches run at its predicted weights, Parameter objects of their
    own on every stage) and dc (step t's gradients compensated at its apply, their norms for
    clipping a step late: swarm.engine.versions) give one process's run of the same correction,
    evaluation and drain included, and not the uncorrected run's."""
    uncorrected = smoke(*OVERRIDES, "train.delay_correction=none")
    plain = [r["loss"] for r in local_rows(uncorrected, tmp_path, steps=6) if r["type"] == "step"]
    # dc's strength is one whose effect on these steps' losses (6e-5 to 2e-3) is past the oracle's 1e-5
    for correction, first in (("lookahead", 2), ("dc:100000", 3)):  # the first step whose loss it changes
        cfg = smoke(*OVERRIDES, f"train.delay_correction={correction}")
        reference = _assert_one_process(swarm_rows(swarm, cfg, steps=6), local_rows(cfg, tmp_path, steps=6))
        assert reference[:first] == plain[:first]  # before the first update there is nothing to correct
        # past the oracle's 1e-5 somewhere (not at every step: lookahead moved step 4's loss by only
        # 2.3e-5 on one machine), so a swarm that ran without the correction fails the comparison
        changes = [abs(a - b) / b for a, b in zip(reference[first:], plain[first:], strict=True)]
        assert max(changes) > 3e-4, (correction, changes)


@pytest.mark.parametrize("correction", ["none", "lookahead"])
def test_recomputed_activations_run_asynchronously_at_their_micro_batchs_weights(swarm, tmp_path, correction):
    """train.checkpoint_activations: a stage recomputes a micro-batch's forward in its backward,
    by which time the stage may have applied an update (weight stashing gave the optimizer new
    parameter objects) or run the next step at its own predicted weights (lookahead). The
    recomputation runs with the objects its forward ran with, so the losses are one process's."""
    cfg = smoke(*OVERRIDES, "train.checkpoint_activations=true", f"train.delay_correction={correction}")
    _assert_one_process(swarm_rows(swarm, cfg, steps=6), local_rows(cfg, tmp_path, steps=6))


# dc's weights (lookahead's last move: test_recovery.py's copies, whose losses change without it;
# without a correction: test_async_replicas.py's final checkpoint and its run back to the copies)
@pytest.mark.parametrize("correction", ["dc:100000"])
def test_an_asynchronous_checkpoint_resumes_in_the_swarm_and_in_one_process(swarm, tmp_path, correction):
    """Checkpoints at steps 3 and 6 hold each stage's last step's gradients unapplied, written as one
    process's kept ones (StageState.saved), with a delay correction's weights (dc's of the held step,
    lookahead's last move). With the newest lost, a new trainer session resumes the swarm from step 3
    (its stages hold step 2's gradients again; the trainer makes step 2's decision anew from their
    norms, a round: dc's compensated at the weights they are applied to), one process resumes the
    same files, and the swarm resumes one process's checkpoint: each repeats the uninterrupted
    one-process run, clipping and error feedback included."""
    cfg = smoke(
        "model.num_stages=3",
        "optimizer.grad_clip=0.05",
        "compression.forward=topk:0.2+ef21",
        "compression.backward=topk:0.2+ef21",
        "train.eval_every=100",
        "train.schedule=async",
        f"train.delay_correction={correction}",
    )
    ours, theirs = tmp_path / "swarm", tmp_path / "one"
    run_experiment(cfg, tmp_path / "one.jsonl", 6, progress=False, checkpoint=Checkpointing(str(theirs), 3))
    reference = step_losses(read_results(tmp_path / "one.jsonl"))
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    data = build_data(cfg)

    def swarm_run(directory) -> tuple[list[dict], dict]:
        rows = ResultsWriter(None)
        pipeline = swarm.pipeline(cfg, run_id, 6, data)
        train(cfg, pipeline, data, rows, 6, progress=False, checkpoint=Checkpointing(str(directory), 3))
        return rows.rows, pipeline.summary_notes()

    try:
        first, _ = swarm_run(ours)
        assert_close_losses(step_losses(first), reference)
        for stage in range(3):  # one process's format: the sum of step 2's gradients, not yet applied
            mine, one = (torch.load(run_dir(d, 3) / f"stage{stage}.pt", weights_only=True) for d in (ours, theirs))
            assert mine["step"] == one["step"] == 3 and mine["delay"]["kept"].keys() == one["delay"]["kept"].keys()
            for part in ("kept", "then", "moved"):  # then: dc's only; moved: lookahead's
                assert (mine["delay"][part] is None) == (one["delay"][part] is None), (stage, part)
                assert (mine["delay"][part] or {}).keys() == (one["delay"][part] or {}).keys(), (stage, part)
                for name, value in (one["delay"][part] or {}).items():
                    assert torch.equal(mine["delay"][part][name], value), (stage, part, name)
        shutil.rmtree(run_dir(ours, 6))
        resumed, notes = swarm_run(ours)
        assert [r["step"] for r in resumed if r["type"] == "step"] == [4, 5, 6]
        assert_close_losses(step_losses(resumed), reference[3:])
        # the held norms of step 2, once per stage; a first run on a cold swarm may retry a
        # micro-batch, whose step then closes by a round of its own (and dc's step before it too)
        gathers = notes["round_calls"]["gather"]
        assert gathers % 3 == 0 and 3 <= gathers <= 9 and notes["closed_on_the_way"] >= 2, notes
        shutil.rmtree(run_dir(theirs, 6))
        assert_close_losses(step_losses(swarm_run(theirs)[0]), reference[3:])  # one process's checkpoint, in the swarm
    finally:
        swarm.unhost(run_id)
    shutil.rmtree(run_dir(ours, 6))
    local = tmp_path / "resumed.jsonl"
    run_experiment(cfg, local, 6, progress=False, checkpoint=Checkpointing(str(ours), 3))
    assert_close_losses(step_losses(read_results(local)), reference[3:])  # the swarm's checkpoint, in one process


def _reply_lost(swarm, cfg, steps: int, lost_at: tuple[int, int], late_s: float = 0.0, snapshot_every: int = 0):
    """A run of `cfg` on three shared hosts whose stage 0 loses its reply of micro-batch `lost_at`
    (step, index) once, `late_s` after the micro-batch went through every stage: the trainer sends it
    again. Its rows and its pipeline."""
    run_id = uuid.uuid4().hex[:8]
    chain = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])[0].chain
    original, lost = chain.run, []

    async def reply_lost_once(head, payload, sender):
        outcome = await original(head, payload, sender)
        if (head.batch.step, head.batch.index) == lost_at and not lost:
            lost.append(head.batch.attempt)
            await asyncio.sleep(late_s)
            raise RemoteError("stage 1 did not answer in time (a test's lost reply)", pb.DOWNSTREAM)
        return outcome

    chain.run = reply_lost_once
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, steps, data, snapshot_every=snapshot_every)
        rows = ResultsWriter(None)
        train(cfg, pipeline, data, rows, steps, progress=False)
    finally:
        swarm.unhost(run_id)
    assert lost
    return rows.rows, pipeline


LOSSY = (
    "model.num_stages=3",
    "optimizer.grad_clip=0.05",
    "compression.forward=quant:4",
    "compression.backward=quant:4",
)


@pytest.mark.parametrize("correction", ["none", "dc:100000"])
def test_an_asynchronous_step_whose_micro_batch_was_retried_closes_by_a_round(swarm, tmp_path, correction):
    """Micro-batch 1 of step 4 goes through every stage, but stage 0's reply is lost: the trainer
    sends it again, and every stage holds it once more (held per micro-batch: it counts once). The
    step cannot close on the way, so one round takes every stage's norm of its held gradients (with
    dc, once step 3 is applied everywhere: by a round where step 5's micro-batches did not bring it
    yet); its decision still rides with step 6's micro-batches, and the losses are one process's."""
    cfg = smoke(*LOSSY, "train.schedule=async", f"train.delay_correction={correction}")
    rows, pipeline = _reply_lost(swarm, cfg, 8, (4, 1))  # step 4 is followed by an evaluation
    assert pipeline.handoff.retries == 1
    theirs = local_rows(cfg, tmp_path, steps=8)
    assert_close_losses(step_losses(rows), step_losses(theirs))
    lrs = ([r["lr"] for r in run if r["type"] == "step"] for run in (rows, theirs))
    assert next(lrs) == pytest.approx(next(lrs))  # step 4's: the rate its micro-batches ran at, by the round
    summary = rows[-1]
    # step 4 by one round (3 peers); on a loaded machine step 5 too, when its micro-batches went out
    # before step 4's retry (the handoff's retries differ from those it was planned with)
    by_round = 8 - summary["closed_on_the_way"]
    assert by_round in (1, 2) and summary["round_calls"]["gather"] == 3 * by_round, summary["round_calls"]
    applies = summary["round_calls"].get("apply", 0)  # dc: the step before, where no micro-batch brought it
    assert applies % 3 == 0 and applies <= (3 * by_round if correction != "none" else 0), summary["round_calls"]


def test_a_micro_batch_sent_again_after_the_next_step_moved_on_runs_at_its_steps_kept_weights(
    swarm, tmp_path, monkeypatch
):
    """Stage 0's reply of micro-batch (2, 1) is lost, and late: meanwhile step 3's micro-batches
    went out and moved every stage's weights on. When it comes again, every stage runs it at the
    weights step 2 ran at, which each keeps until its next update (swarm.engine.stash): no pause,
    one process's losses. (It used to be refused, and the run went back to the swarm's copies.)"""
    late = forwards_at_kept_weights(monkeypatch)
    cfg = smoke(*LOSSY, "train.eval_every=100", "train.schedule=async")
    rows, pipeline = _reply_lost(swarm, cfg, 6, (2, 1), late_s=2.0, snapshot_every=2)
    assert late.count(2) >= 3  # its forward at every stage
    assert pipeline.recovery.history.pauses == [] and pipeline.handoff.retries >= 1
    assert_close_losses(step_losses(rows), step_losses(local_rows(cfg, tmp_path, steps=6)))


def test_a_stage_that_lost_a_micro_batchs_gradients_before_the_held_round_goes_back_to_the_copies(swarm, tmp_path):
    """Step 4 closes by the held round (the trainer is made to plan it so), and by then stage 2 has
    lost micro-batch 0's gradients (as when the peer that ran it left): step 5's micro-batches moved
    the weights on, so it cannot run again, and the run goes back to the swarm's copies of step 4 and
    replays it (the stage's refusal ended the run before), with one process's losses."""
    cfg = smoke(*LOSSY, "train.eval_every=100", "train.schedule=async")
    run_id = uuid.uuid4().hex[:8]
    stage2 = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])[2]
    handle, forgot = stage2.rounds.handle, []

    async def forgetting(kind, head, payload):
        if kind == "gather" and head.held and head.step == 4 and not forgot:
            forgot.append(stage2.runtime.held.pop((Mode.TRAIN.value, 4, 0), None))
        return await handle(kind, head, payload)

    stage2.rounds.handle = forgetting
    try:
        data = build_data(cfg)
        pipeline = swarm.pipeline(cfg, run_id, 6, data, snapshot_every=2)
        plan = pipeline.closing.plan
        pipeline.closing.plan = lambda step, count, retries: 0 if step == 4 else plan(step, count, retries)
        rows = ResultsWriter(None)
        train(cfg, pipeline, data, rows, 6, progress=False)
    finally:
        swarm.unhost(run_id)
    assert forgot and forgot[0] is not None
    assert [(p["from_step"], p["to_step"]) for p in pipeline.recovery.history.pauses] == [(4, 4)]
    assert_close_losses(step_losses(rows.rows), step_losses(local_rows(cfg, tmp_path, steps=6)))
