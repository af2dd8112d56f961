"""The order `python -m swarm bench fuzz` sends its cases in, and what each kind cost the peers.

Cases go in rounds, one kind at a time (swarm.bench.fuzz_cases.ROUNDS), `concurrency` at once over
every target: the CPU the stage servers spent on the fuzzer's requests during a round
(swarm.transport.hivemind.net.cpu: every request's, refused or not) is that kind's. The vandal's
floods come first (swarm.bench.fuzz_floods: held open at a target before its first is completed,
so the vandal is not banned there yet), then its other rounds, the stranger's and the member's.
The stalled streams are the member's and run from the start, beside the vandal's and the
stranger's rounds: what the member cost meanwhile is theirs. A round's senders start unbanned.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from protocols.stubs import STUBS
from swarm.bench.fuzz import Tally, send
from swarm.bench.fuzz_cases import ROUNDS, Case, Cases, Target
from swarm.bench.fuzz_floods import FLOODS, Held, flood_messages, timed
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address


@dataclass
class Senders:
    """The fuzzer's nodes: a stranger (never admitted), a member (holding an admission to each
    target's previous stage, as if its key were stolen), a vandal (a stranger that sends bytes no
    peer of the protocol writes: banned at its first, so the others' cases still reach the checks
    behind), and a reader of statuses (anyone may ask one)."""

    stranger: object
    member: object
    vandal: object
    reader: object


@dataclass(frozen=True)
class Plan:
    count: int  # cases, over every round
    limit_s: float  # for a reply
    stall_limit_s: float  # for a stalled stream to be closed
    concurrency: int = 8
    stalls: int = 4
    floods: int = 2  # messages of each kind of flood, per target
    seed: int = 0


class Served:
    """The stage servers under test, as the fuzzer reads them (on their loop)."""

    def __init__(self, servers: list) -> None:
        self.servers = servers

    def spent(self, peer_ids) -> float:
        """CPU seconds they spent on these senders' requests."""
        return sum(s.refusals.cpu.spent[p] for s in self.servers for p in peer_ids)

    def forgive(self, peer_ids) -> None:
        """Lifts these senders' bans: a round starts as from new peer ids (which cost a stranger
        nothing: docs/security.md, Sybils), so its first case at each peer reaches the checks it is
        meant for."""
        for server in self.servers:
            for peer in peer_ids:
                server.refusals.banned.succeed(peer)

    def serving(self, peer_ids) -> int:
        """Requests of these senders they still serve (their cost not counted yet)."""
        return sum(s.active[p] for s in self.servers for p in peer_ids)


def shares(count: int) -> dict[str, int]:
    """How many of `count` cases each kind of ROUNDS takes (by its share; the rest to the largest)."""
    total = sum(weight for _, weight, _ in ROUNDS.values())
    out = {kind: count * weight // total for kind, (_, weight, _) in ROUNDS.items()}
    out[max(ROUNDS, key=lambda kind: ROUNDS[kind][1])] += count - sum(out.values())
    return out


class Campaign:
    def __init__(self, senders: Senders, targets: list[Target], plan: Plan, served: Served) -> None:
        self.senders, self.targets, self.plan, self.served = senders, targets, plan, served
        self.makers = [Cases(t, plan.seed + i) for i, t in enumerate(targets)]
        self.tally = Tally()
        self.ids = {who: getattr(senders, who).peer_id for who in ("stranger", "member", "vandal")}

    async def run(self) -> Tally:
        plan, started = self.plan, time.monotonic()
        stalls = asyncio.gather(*(self._one(i, "stall", plan.stall_limit_s) for i in range(plan.stalls)))
        before = self.served.spent([self.ids["member"]])
        await self._floods()
        counts = shares(plan.count)
        for kind in [k for k, (_, _, who) in ROUNDS.items() if who != "member"]:
            await self._round(kind, counts[kind], [self.ids["stranger"], self.ids["vandal"]])
        sent = sum(len(case.data) for case in await stalls)
        await self._quiet([self.ids["member"]], started)
        self.tally.cost("stalled stream", plan.stalls, sent, self.served.spent([self.ids["member"]]) - before)
        for kind in [k for k, (_, _, who) in ROUNDS.items() if who == "member"]:
            await self._round(kind, counts[kind], list(self.ids.values()))
        return self.tally

    async def _one(self, i: int, kind: str, limit_s: float) -> Case:
        """One case of `kind` at target i, made when its turn comes: the peer's step as it is then."""
        target, maker = self.targets[i % len(self.targets)], self.makers[i % len(self.targets)]
        case = maker.stall() if kind == "stall" else maker.make(kind)
        started = time.monotonic()
        sender = self.senders.member if case.member else self.senders.vandal if case.vandal else self.senders.stranger
        try:
            outcome, detail = await send(sender.p2p, target.peer_id, case, limit_s)
        except Exception as e:  # opening the stream failed: the peer is gone (a crash)
            outcome, detail = "hung", f"{type(e).__name__}: {e}"[:120]
        self.tally.add(case.category, outcome, time.monotonic() - started, detail)
        return case

    async def _round(self, kind: str, count: int, senders: list[str]) -> None:
        self.served.forgive(senders)
        slots, before, started = asyncio.Semaphore(self.plan.concurrency), self.served.spent(senders), time.monotonic()

        async def one(i: int) -> int:
            async with slots:
                return await self._one(i, kind, self.plan.limit_s)

        cases = await asyncio.gather(*(one(i) for i in range(count)))
        await self._quiet(senders, started)
        metered = all(case.handler is None for case in cases)  # another handler (hivemind's) is not
        cpu_s = self.served.spent(senders) - before if metered else None
        self.tally.cost(ROUNDS[kind][0], count, sum(len(case.data) for case in cases), cpu_s)

    async def _quiet(self, senders: list[str], since: float, held: int = 0) -> None:
        """Until the servers have counted what the senders' requests cost (a refused request's
        drain outlives its reply), but for `held` ones still held open, within the limit of a reply."""
        while self.served.serving(senders) > held and time.monotonic() - since < self.plan.limit_s:
            await asyncio.sleep(0.01)

    async def _floods(self) -> None:
        """Every kind of flood at every target, a status call to it with each message."""
        plan, vandal = self.plan, [self.ids["vandal"]]
        for i, target in enumerate(self.targets):

            def status(peer=target.peer_id, run_id=target.run_id):
                return ask(self.senders.reader.streams, peer, STUBS.info(to=address(run_id)), plan.limit_s)

            await timed(status)  # the reader's stream to it is open before the floods come
            messages = [m for kind in FLOODS for m in flood_messages(kind, plan.floods, plan.seed + i)]
            held = await Held.open(self.senders.vandal.p2p, target.peer_id, messages)
            with contextlib.closing(held):
                for kind in FLOODS:
                    before, started = self.served.spent(vandal), time.monotonic()
                    flooded = await held.complete(plan.floods, status, plan.limit_s)
                    await self._quiet(vandal, started, held=len(held.waiting))
                    seconds = (time.monotonic() - started) / plan.floods
                    for outcome, detail in flooded.outcomes:
                        self.tally.add(kind, outcome, seconds, detail)
                    self.tally.info_s.extend(flooded.info_s)
                    sent = plan.floods * len(messages[0])
                    self.tally.cost(kind, plan.floods, sent, self.served.spent(vandal) - before)


async def campaign(senders: Senders, targets: list[Target], plan: Plan, served: Served) -> Tally:
    """Every round of `plan` at `targets`, from `senders`; the outcomes and what they cost."""
    return await Campaign(senders, targets, plan, served).run()
