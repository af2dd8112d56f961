"""`train.schedule: async` over a swarm of a model with tied parameters (GPT-2's embedding on stage 0
and LM head on stage 2), on real hivemind (loopback): every step closes by the held round, which sums
the tied parameter's gradients across the two stages after each stage's delay correction, as one
process ties them (swarm.engine.step `tie` after swarm.engine.delay's swap). The oracle is one
process's asynchronous run, within 1e-5; clipping binds at every step, so the tied parameter's norm,
counted once, is in the floats compared."""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
import torch
from _swarm_env import assert_close_losses, step_losses, tiny_gpt2

from swarm.training.checkpoints import Checkpointing, run_dir
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import train
from swarm.training.results import ResultsWriter, read_results

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)

STEPS = 6
DC = "dc:1000"  # strong enough that tying before the correction instead of after it shows


def _run(swarm, cfg, run_id: str, steps: int = STEPS, checkpoint=None):
    data = build_data(cfg)
    rows = ResultsWriter(None)
    pipeline = swarm.pipeline(cfg, run_id, steps, data)
    train(cfg, pipeline, data, rows, steps, progress=False, checkpoint=checkpoint)
    return rows.rows, pipeline.summary_notes()


def _tied_copies(hosted) -> list[torch.Tensor]:
    copies = [h.runtime.module.get_parameter("wte.weight") for h in hosted if h.stage == 0]
    return copies + [h.runtime.module.get_parameter("lm_head.weight") for h in hosted if h.stage == 2]


@pytest.mark.parametrize(
    "correction, placement",
    [("none", [(0, 0), (1, 1), (2, 2)]), (DC, [(0, 0), (1, 1), (2, 2)]), (DC, [(0, 0), (1, 1), (2, 2), (2, 4)])],
    ids=["none", "dc", "dc-replicas-on-a-tied-stage"],
)
def test_tied_parameters_are_summed_across_their_stages_by_the_held_round(swarm, tmp_path, correction, placement):
    """Each stage alone, then stage 2 (the LM head's) with two replicas: they sum what they ran,
    compensate their whole sum (dc), and one of them brings the stage's part to the tied group. The
    losses are one process's, both copies of the tied weight stay equal on every peer, and no
    gradient passes through the trainer."""
    cfg = tiny_gpt2(tmp_path, "train.schedule=async", f"train.delay_correction={correction}")
    theirs = step_losses(read_results(_one_process(cfg, tmp_path)))
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, placement)
    try:
        rows, notes = _run(swarm, cfg, run_id)
        assert_close_losses(step_losses(rows), theirs)
        copies = _tied_copies(hosted)
        assert len(copies) == placement.count((2, 4)) + 2
        assert all(torch.equal(copies[0], c) for c in copies[1:])
        assert notes["closed_on_the_way"] == 0 and notes["round_bytes"].get("gather.received", 0) == 0, notes
    finally:
        swarm.unhost(run_id)
    if correction == DC and len(placement) == 3:  # the correction matters here: tying first would differ
        (tmp_path / "plain").mkdir()
        plain = step_losses(
            read_results(
                _one_process(
                    tiny_gpt2(tmp_path / "plain", "train.schedule=async", "train.delay_correction=none"), tmp_path
                )
            )
        )
        assert max(abs(a - b) / b for a, b in zip(theirs, plain, strict=True)) > 3e-4


def _one_process(cfg, tmp_path, steps: int = STEPS, checkpoint=None):
    path = tmp_path / f"one-{uuid.uuid4().hex[:6]}.jsonl"
    run_experiment(cfg, path, steps, progress=False, checkpoint=checkpoint)
    return path


def test_a_resumed_asynchronous_run_with_tied_parameters_sums_the_kept_gradients_again(swarm, tmp_path):
    """A checkpoint of step 3 holds each stage's step-2 gradients unapplied, untied (one process's
    kept ones). A new session resumes it: its held round of step 2 has every peer hold the whole
    step and sums only the tied parameter, and steps 4-6 are one process's."""
    cfg = tiny_gpt2(tmp_path, "train.schedule=async", f"train.delay_correction={DC}", "train.eval_every=100")
    ours = tmp_path / "swarm"
    theirs = step_losses(read_results(_one_process(cfg, tmp_path)))
    run_id = uuid.uuid4().hex[:8]
    swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    try:
        first, _ = _run(swarm, cfg, run_id, checkpoint=Checkpointing(str(ours), 3))
        assert_close_losses(step_losses(first), theirs)
        shutil.rmtree(run_dir(ours, STEPS))
        resumed, _ = _run(swarm, cfg, run_id, checkpoint=Checkpointing(str(ours), 3))
        assert [r["step"] for r in resumed if r["type"] == "step"] == [4, 5, 6]
        assert_close_losses(step_losses(resumed), theirs[3:])
    finally:
        swarm.unhost(run_id)


def test_a_joiner_of_the_lm_heads_stage_downloads_its_untied_kept_gradients_and_ties_with_the_others(swarm, tmp_path):
    """A stage-2 peer (the LM head's) announced after step 1 joins where the pipeline drained: it
    downloads the stage with its held step's gradients untied, as a checkpoint keeps them, and the
    held rounds from then on sum it with its replica (whether the routers gave it micro-batches in
    these few steps or not), then tie the stage's whole with stage 0's: all three copies of the
    tied weight stay equal and the losses are one process's."""
    cfg = tiny_gpt2(tmp_path, "train.schedule=async", f"train.delay_correction={DC}")
    theirs = step_losses(read_results(_one_process(cfg, tmp_path)))
    run_id = uuid.uuid4().hex[:8]
    hosted = swarm.host(cfg, run_id, [(0, 0), (1, 1), (2, 2)])
    joiner = []

    class Announcing(ResultsWriter):
        def write(self, row) -> None:
            super().write(row)
            if row.get("type") == "step" and row["step"] == 1:
                joiner.extend(swarm.host(cfg, run_id, [(2, 4)]))
                peer, deadline = joiner[0].node.peer_id, time.monotonic() + 30
                while not any(r.peer_id == peer for r in swarm.loop.run(pipeline.router.peers(2, refresh=True))):
                    assert time.monotonic() < deadline, "the DHT never showed the joiner"
                    time.sleep(0.05)  # before step 2 starts, so the loop drains for it after step 2

    try:
        data = build_data(cfg)
        rows = Announcing(None)
        pipeline = swarm.pipeline(cfg, run_id, STEPS, data)
        train(cfg, pipeline, data, rows, STEPS, progress=False)
        assert_close_losses(step_losses(rows.rows), theirs)
        assert joiner and joiner[0].state.joined is not None and joiner[0].node.peer_id in pipeline.members[2]
        copies = _tied_copies([*hosted, *joiner])
        assert len(copies) == 3 and all(torch.equal(copies[0], c) for c in copies[1:])
    finally:
        swarm.unhost(run_id)
