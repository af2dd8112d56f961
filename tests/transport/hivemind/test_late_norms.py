"""dc's decisions in a swarm (swarm.transport.hivemind.trainer.late_norms): a step's norms come with
the next step's first micro-batch, before or after the loop closed it; the decision is made once
both happened, and what brings it waits until then. No network: the trainer's bookkeeping only."""

from __future__ import annotations

import asyncio

import pytest

from protocols.wire_names import LATE, LR
from swarm.transport.hivemind.trainer.late_norms import LateDecisions


def _decisions():
    decided = []
    return LateDecisions(2, lambda step, squares, clip: decided.append((step, dict(squares), clip))), decided


def test_a_step_is_decided_when_closed_and_all_its_norms_came_in_either_order():
    async def run():
        late, decided = _decisions()
        late.heard(1, {f"{LATE}1": 4.0, LR: 0.1})  # norms of step 0, before the loop closed it
        assert decided == []
        await late.closed(0, 0.5)
        assert decided == []  # stage 0's norm is still to come
        late.heard(1, {f"{LATE}0": 9.0})
        assert decided == [(0, {0: 9.0, 1: 4.0}, 0.5)]
        await late.closed(1, 0.5)  # its norms come later: step 3's micro-batches wait
        waiter = asyncio.ensure_future(late.ready(1))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        late.heard(2, {f"{LATE}0": 1.0, f"{LATE}1": 2.0})
        await asyncio.wait_for(waiter, 1)
        assert decided[-1] == (1, {0: 1.0, 1: 2.0}, 0.5)
        await asyncio.wait_for(late.ready(7), 1)  # no decision of step 7 is coming: nothing to wait for
        await late.closed(2, None)
        with pytest.raises(RuntimeError, match=r"^step 2 of a train.delay_correction dc run in a swarm got no norms"):
            await late.closed(3, None)

    asyncio.run(run())


def test_forgetting_lets_whatever_waits_go_on():
    async def run():
        late, decided = _decisions()
        await late.closed(0, 0.5)
        waiter = asyncio.ensure_future(late.ready(0))
        await asyncio.sleep(0.01)
        late.forget()
        await asyncio.wait_for(waiter, 1)
        assert decided == [] and late.waiting == {}

    asyncio.run(run())
