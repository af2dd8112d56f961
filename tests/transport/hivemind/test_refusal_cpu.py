"""What a request costs a peer in CPU (swarm.transport.hivemind.net.cpu), and the budget of a
sender's refusals: in process, with a clock the test moves."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protocols import stage_pb2 as pb
from protocols.errors import MalformedMessage, ProtocolError, Replied, SenderFault
from swarm.transport.hivemind.net.cpu import RefusalBudget, RequestCpu, charged
from swarm.transport.hivemind.net.events import EventLog
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.refusals import Refusals


def _spin(seconds: float) -> None:
    """Uses this thread's CPU for `seconds`."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_request_counts_its_own_steps_and_the_work_it_hands_to_another_thread():
    executor = ThreadPoolExecutor(1)

    async def request() -> str:
        _spin(0.02)
        await asyncio.sleep(0)  # another task's turn: not ours
        _spin(0.02)
        await asyncio.get_running_loop().run_in_executor(executor, charged(_spin), 0.03)
        return "done"

    async def other() -> None:
        _spin(0.05)

    async def main():
        cpu = RequestCpu()
        outcome, _ = await asyncio.gather(cpu.run(request()), other())
        assert charged(_spin) is _spin  # outside a request: nothing to count toward
        return outcome, cpu

    outcome, cpu = asyncio.run(main())
    executor.shutdown()
    assert outcome == "done"
    assert 0.04 <= cpu.loop_s < 0.08  # the other task's 0.05 s is not in it
    assert 0.03 <= cpu.other_s < 0.06


def test_a_cancelled_request_still_counts_what_it_cost():
    async def main():
        cpu = RequestCpu()

        async def request():
            _spin(0.02)
            await asyncio.Event().wait()

        task = asyncio.ensure_future(cpu.run(request()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cpu

    assert asyncio.run(main()).loop_s >= 0.02


def test_a_sender_over_its_share_of_a_core_is_over_budget_and_its_budget_refills():
    now = [0.0]
    budget = RefusalBudget(share=0.1, window_s=10.0, clock=lambda: now[0])  # 1 s of refusals at once
    assert not budget.refused("a", 0.6)
    assert budget.refused("a", 0.6)  # 1.2 s within the window
    assert not budget.refused("b", 0.6)  # another sender has its own
    now[0] += 20.0  # refilled at 0.1 s a second, up to 1 s
    assert not budget.refused("a", 0.3) and not budget.refused("a", 0.3)
    assert budget.refused_s == pytest.approx(2.4)


def test_malformed_bytes_ban_their_sender_and_refusals_count_toward_its_budget():
    settings = Settings.of(refusal_cpu_share=0.1, refusal_cpu_window_s=10.0)
    refusals = Refusals(settings, EventLog())
    assert refusals.refused("zeros", "request", MalformedMessage("a malformed StageRequest")) == "malformed message"
    assert refusals.banned.banned("zeros")
    assert refusals.refused("member", "micro_batch", SenderFault("targets: float32")) == "malformed payload"
    assert refusals.banned.banned("member")
    # a refusal that is not malformed bans only once it has cost more than the sender's budget
    relayed = Replied("refused downstream", pb.REFUSED)
    refusals.charge("relay", "micro_batch", 5.0, relayed)  # another peer's word: not this sender's doing
    assert not refusals.banned.banned("relay")
    not_allowed = ProtocolError("expected a setup head")
    refusals.charge("caller", "setup", 0.5, not_allowed)
    assert not refusals.banned.banned("caller")
    refusals.charge("caller", "setup", 0.6, not_allowed)
    assert refusals.banned.banned("caller")
    assert any("cost more than 0.1 of a core over 10s" in e.text for e in refusals.events.last())
    refusals.charge("trainer", "micro_batch", 30.0, None)  # served: its work, however long
    assert not refusals.banned.banned("trainer") and refusals.cpu.spent["trainer"] == 30.0
    assert refusals.turned_away("caller").code == pb.REFUSED and refusals.turned_away("trainer") is None
