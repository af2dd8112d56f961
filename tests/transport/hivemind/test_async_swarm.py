"""`train.schedule: async` over a swarm on real hivemind (loopback, never mocked), on the session's
shared swarm: the oracle is one process's asynchronous run (swarm.engine.delay)."""

from __future__ import annotations

import pytest
from _swarm_env import local_rows, smoke, swarm_rows


def test_an_asynchronous_schedule_overlaps_steps_with_the_floats_of_one_process(swarm, tmp_path):
    """train.schedule async (swarm.engine.delay): the next step's micro-batches enter while a step's
    are in flight, each stage applies step t's gradients when step t + 2's first micro-batch comes
    and stashes the weights step t + 1's pending backward needs. The losses, learning rates and
    evaluations of one process's asynchronous run, which are not its synchronous run's."""
    overrides = ["model.num_stages=4", "optimizer.grad_clip=0.05", "compression.forward=quant:4+ef"]
    overrides.append("compression.backward=quant:4")
    cfg = smoke(*overrides, "train.schedule=async")
    rows, theirs = swarm_rows(swarm, cfg, steps=6), local_rows(cfg, tmp_path, steps=6)
    steps, reference = ([r for r in run if r["type"] == "step"] for run in (rows, theirs))
    assert len(steps) == len(reference) == 6
    for a, b in zip(steps, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"])
    evals, reference_evals = ([r["uncompressed"] for r in run if r["type"] == "eval"] for run in (rows, theirs))
    assert len(evals) == len(reference_evals) == 2  # at step 5 (the pipeline drains first) and at the end
    for a, b in zip(evals, reference_evals, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    summary, their_summary = rows[-1], theirs[-1]
    assert summary["bytes"] == their_summary["bytes"]  # a step's row may count bytes of the next one's
    assert summary["closed_on_the_way"] == summary["steps"] == 6 and summary["round_calls"] == {}
    assert summary["overlapped_steps"] >= 3  # of steps 1..4 (step 5 follows an evaluation)
    synchronous = [r["loss"] for r in local_rows(smoke(*overrides), tmp_path, steps=6) if r["type"] == "step"]
    assert synchronous[0] == reference[0]["loss"]  # the same first step; then one step late
    assert all(loss != r["loss"] for loss, r in zip(synchronous[1:], reference[1:], strict=True))


def test_a_stage_with_two_peers_is_refused_at_the_first_step_in_one_line(swarm):
    """Replicas sum their gradients by the rounds, which cannot apply a step late yet."""
    cfg = smoke("model.num_stages=3", "train.schedule=async")
    with pytest.raises(ValueError, match=r"^step 0: train.schedule async runs in a swarm with one peer per stage, "):
        swarm_rows(swarm, cfg, steps=2, placement=[(0, 0), (1, 1), (1, 4), (2, 2)])
