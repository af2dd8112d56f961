"""`train.schedule: async` over a swarm on real hivemind (loopback, never mocked), on the session's
shared swarm: the oracle is one process's asynchronous run (swarm.engine.delay)."""

from __future__ import annotations

import pytest
from _swarm_env import local_rows, smoke, swarm_rows

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
    plain = [r["loss"] for r in local_rows(smoke(*OVERRIDES), tmp_path, steps=6) if r["type"] == "step"]
    # dc's strength is one whose effect on these steps' losses (6e-5 to 2e-3) is past the oracle's 1e-5
    for correction, first in (("lookahead", 2), ("dc:100000", 3)):  # the first step whose loss it changes
        cfg = smoke(*OVERRIDES, f"train.delay_correction={correction}")
        reference = _assert_one_process(swarm_rows(swarm, cfg, steps=6), local_rows(cfg, tmp_path, steps=6))
        assert reference[:first] == plain[:first]  # before the first update there is nothing to correct
        assert all(abs(a - b) > 3e-5 * b for a, b in zip(reference[first:], plain[first:], strict=True)), correction


def test_a_stage_with_two_peers_is_refused_at_the_first_step_in_one_line(swarm):
    """Replicas sum their gradients by the rounds, which cannot apply a step late yet."""
    cfg = smoke("model.num_stages=3", "train.schedule=async")
    with pytest.raises(ValueError, match=r"^step 0: train.schedule async runs in a swarm with one peer per stage, "):
        swarm_rows(swarm, cfg, steps=2, placement=[(0, 0), (1, 1), (1, 4), (2, 2)])
