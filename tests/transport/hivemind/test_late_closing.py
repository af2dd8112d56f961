"""The trainer's side of an asynchronous step that closes late (trainer.closing), in process: the
rounds are a stand-in that reports held norms, the owner signs for real."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm.engine.step import clip_scale
from swarm.transport.hivemind.trainer.closing import StepClosing
from swarm.transport.hivemind.trust.owner import Owner


class _Rounds:
    """Every stage's held norm of a step (their sum), the rate, and the applies a settle makes."""

    def __init__(self, squares: float) -> None:
        self.squares, self.asked, self.applies = squares, [], []

    async def held(self, step: int, count: int) -> tuple[float, float]:
        self.asked.append((step, count))
        return self.squares, 0.04

    async def applied(self, step: int, scale: float, codecs=()) -> None:
        self.applies.append(step)
        self.codecs = list(codecs)


def _closing(depth: int = 2, squares: float = 9.0, correction: str = "none", tied=()) -> StepClosing:
    owner = Owner(RSAPrivateKey.process_wide(), "run", (), False)
    place = SimpleNamespace(owner=owner, session="s", num_stages=3, tied=list(tied))
    train = SimpleNamespace(micro_batches=4, delay_correction=correction)
    membership = SimpleNamespace(members={0: ["a"], 1: ["b"], 2: ["c"]}, following=set())  # one peer per stage
    return StepClosing(place, membership, _Rounds(squares), train, True, depth)


def test_a_step_that_cannot_close_on_the_way_closes_by_one_round_and_its_decision_rides_two_steps_later():
    closing = _closing()
    assert closing.close(5, 0.5, retries=0) is None  # never planned (a micro-batch retried): by the round
    assert asyncio.run(closing.late_round(5, 0.5)) == 0.04
    assert closing.rounds.asked == [(5, 4)]
    decision = closing.decision_for(7)
    assert decision.step == 5 and decision.scale == clip_scale(9.0, [], 0.5) > 0
    assert closing.decision_for(6) is None and closing.last == 5 and closing.closed == 0


@pytest.mark.parametrize("step", [0, 1, 6])
def test_a_restored_asynchronous_run_makes_its_last_steps_decision_again(step):
    closing = _closing()
    closing.pending = {9: closing.place.owner.decide("s", 9, 0.0)}  # of the steps given up
    asyncio.run(closing.reopen(step, 0.5))
    if not step:  # nothing ran before step 0: nothing is held, nothing pending
        assert closing.pending == {} and closing.rounds.asked == []
        return
    assert list(closing.pending) == [step - 1] and closing.rounds.asked == [(step - 1, 4)]
    assert closing.decision_for(step + 1).scale == clip_scale(9.0, [], 0.5)  # with step + 1's micro-batches
    asyncio.run(closing.settle())  # a drain before step `step` runs: the decision still waits
    assert closing.rounds.applies == [] and step - 1 in closing.pending


def test_tied_parameters_and_adaptive_codecs_close_every_asynchronous_step_by_the_round():
    """A tied parameter's sum across two stages takes the held round (test_async_tied.py), so such
    a step never closes on the way; nor does one of a run whose codecs may change."""
    tied = [((0, "wte.weight"), (2, "lm_head.weight"))]
    assert _closing(tied=tied).plan(0, 4, 0) == 0  # by the held round, which sums them
    assert _closing(depth=1, tied=tied).plan(0, 4, 0) == 0  # synchronous: by the rounds, which sum them
    assert _closing(correction="dc:10").plan(0, 4, 0) == 4  # a correction closes on the way too
    adaptive = _closing()
    adaptive.fixed_codecs = False
    assert adaptive.plan(0, 4, 0) == 0


@pytest.mark.parametrize("pending", [True, False])
def test_adaptive_codecs_go_with_the_apply_round_of_the_step_before(pending):
    """After step 5 (drained), new codecs go to every peer with step 4's apply round: its pending
    decision is applied by it, and taken out of what step 6's micro-batches bring; with none pending
    (a round applied it already) the round only switches. No change: no round."""
    closing = _closing()
    if pending:
        closing.pending = {4: closing.place.owner.decide("s", 4, 0.25)}
    codecs = ["boundary 0: quant:4"]

    async def adapt(changes):
        return changes

    asyncio.run(closing.switch(5, lambda: adapt([])))
    assert closing.rounds.applies == []
    asyncio.run(closing.switch(5, lambda: adapt(codecs)))
    assert closing.rounds.applies == [4] and closing.rounds.codecs == codecs
    assert closing.decision_for(6) is None and closing.pending == {}


def test_a_synchronous_run_reopens_nothing():
    closing = _closing(depth=1)
    asyncio.run(closing.reopen(6, 0.5))
    assert closing.pending == {} and closing.rounds.asked == [] and closing.last is None


def test_a_dc_step_that_cannot_close_on_the_way_has_the_step_before_applied_first():
    """dc's held norms are of gradients compensated at the weights they apply to: the step before
    is applied everywhere by a round first (here its decision was made from its norms)."""
    closing = _closing(correction="dc:0.1")
    closing.pending = {4: closing.place.owner.decide("s", 4, 0.25)}
    assert asyncio.run(closing.late_round(5, 0.5)) == 0.04
    assert closing.rounds.applies == [4] and closing.rounds.asked == [(5, 4)]
    assert closing.decision_for(7).scale == clip_scale(9.0, [], 0.5)


def test_a_dc_step_before_whose_norms_did_not_all_come_is_decided_by_a_round_then_applied():
    closing = _closing(correction="dc:0.1")
    asyncio.run(closing.late.closed(4, 0.5))  # step 4 closed on the way; its norms never came
    asyncio.run(closing.late_round(5, 0.5))
    assert closing.rounds.asked == [(4, 4), (5, 4)] and closing.rounds.applies == [4]
    assert closing.decision_for(6).scale == closing.decision_for(7).scale == clip_scale(9.0, [], 0.5)
    asyncio.run(closing.late.ready(4))  # nothing waits for step 4 any more
