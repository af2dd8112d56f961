"""The training loop with `train.schedule: async`: it hands the pipeline the next step's
micro-batches with a step's (a swarm starts them early: trainer.dispatch), except where the
pipeline drains after the step (an evaluation, a checkpoint, a swarm's copies, the epoch's or the
run's end)."""

from __future__ import annotations

from _util import SMOKE

from swarm.config import load_config
from swarm.engine.microbatch import Mode
from swarm.training.checkpoints import Checkpointing
from swarm.training.experiment import build_data
from swarm.training.loop import train
from swarm.training.results import ResultsWriter
from swarm.transport.local import build_local_pipeline


def _run(schedule: str, tmp_path, checkpoint_every: int | None = None, copies_every: int | None = None):
    """Every call's (step of its micro-batches, step of `following`'s or None), and the losses."""
    # 10 steps an epoch (400 samples of 40), an evaluation every 5
    cfg = load_config(
        SMOKE, ["model.num_stages=2", f"train.schedule={schedule}", "train.eval_every=0.5", "train.epochs=2"]
    )
    pipeline = build_local_pipeline(cfg, 100)[0]
    calls, run_many = [], pipeline.run_many

    def recording(items, following=()):
        if items and items[0][0].mode is Mode.TRAIN:
            ahead = following[0][0].step if following else None
            assert not following or [b.index for b, _ in following] == list(range(len(following)))
            calls.append((items[0][0].step, ahead))
        return run_many(items, following)

    pipeline.run_many = recording
    if copies_every:  # as a swarm's --snapshot_every
        pipeline.drains = lambda step: step % copies_every == 0
    results = ResultsWriter(None)
    checkpoint = Checkpointing(tmp_path, checkpoint_every) if checkpoint_every else None
    train(cfg, pipeline, build_data(cfg), results, 12, progress=False, checkpoint=checkpoint)
    return calls, [r["loss"] for r in results.rows if r["type"] == "step"]


def test_the_next_step_goes_along_except_before_an_evaluation_an_epochs_end_and_the_runs_end(tmp_path):
    calls, losses = _run("async", tmp_path)
    drained = {4, 9, 11}  # evaluations after steps 5 and 10 (the epoch's end too), the run's end after 12
    assert calls == [(step, None if step in drained else step + 1) for step in range(12)]
    assert len(losses) == 12


def test_a_checkpoint_drains_too_and_a_synchronous_loop_hands_nothing_over(tmp_path):
    calls, _ = _run("async", tmp_path / "async", checkpoint_every=3)
    assert [step for step, ahead in calls if ahead is None] == [2, 4, 5, 8, 9, 11]
    calls, _ = _run("sync", tmp_path / "sync")
    assert all(ahead is None for _, ahead in calls)


def test_the_swarms_copies_drain_too(tmp_path):
    calls, losses = _run("async", tmp_path, copies_every=4)
    assert [step for step, ahead in calls if ahead is None] == [3, 4, 7, 9, 11]  # copies at steps 4 and 8
    assert losses == _run("async", tmp_path / "plain")[1]  # draining changes nothing of the floats
