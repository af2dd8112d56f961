"""The trainer's typed state, in the pieces its collaborators (the step's rounds, recovery, the
status reads) take instead of the whole `SwarmPipeline`:

- `TrainerPlace`: the run and this trainer's session, and the peer's means to reach the swarm.
- `Membership`: who serves which stage in the session, who is still catching up, who was left out.
- `Position`: where the run is: the steps done, and the current step's finished micro-batches.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, one_line
from protocols.stubs import STUBS
from swarm.engine.exactsum import merged_codes, pack_grid, unpack_codes
from swarm.engine.microbatch import MicroBatch
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.events import EventLog
from swarm.transport.hivemind.net.loop import LoopThread
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.net.node import SwarmNode
from swarm.transport.hivemind.net.retry import Retry
from swarm.transport.hivemind.routing.router import Router
from swarm.transport.hivemind.trust.owner import Owner

log = logging.getLogger(__name__)


@dataclass
class TrainerPlace:
    node: SwarmNode
    loop: LoopThread
    run_id: str
    num_stages: int
    owner: Owner  # signs control calls, admits members (swarm.transport.hivemind.trust)
    session: str
    router: Router
    retry: Retry
    events: EventLog  # joins, leaves, bans, pauses: its progress record and metrics show them
    tied: list = field(default_factory=list)  # TiedPairs, as the stages' setup replies name them

    @property
    def settings(self):
        return self.node.settings

    async def statuses(self, peers: list[tuple[int, str]], timeout: float) -> dict[tuple[int, str], object]:
        """Each (stage, peer)'s status of the stage it hosts for this run (`stage_statuses`)."""
        return await stage_statuses(self.node, self.run_id, peers, timeout)


async def stage_statuses(
    node: SwarmNode, run_id: str, peers: list[tuple[int, str]], timeout: float
) -> dict[tuple[int, str], object]:
    """Each (stage, peer)'s status of the stage it hosts for `run_id`, or the exception it raised
    (it did not answer, or no longer hosts that stage). Anyone may ask (`info`)."""
    request = STUBS.info(to=address(run_id))
    replies = await asyncio.gather(
        *(ask(node.streams, peer, request, timeout) for _, peer in peers), return_exceptions=True
    )
    statuses: dict[tuple[int, str], object] = {}
    for (stage, peer), reply in zip(peers, replies, strict=True):
        if isinstance(reply, BaseException):
            statuses[(stage, peer)] = reply
            continue
        found = [s for s in reply.head.stages if s.stage == stage]
        statuses[(stage, peer)] = found[0] if found else RemoteError(f"it no longer hosts stage {stage}")
    return statuses


class Membership:
    """The peers the trainer set up for its session, per stage (`members`), those of them still
    catching up after joining mid-run (`following`), and when each peer was left out (records of it
    from before then are stale)."""

    def __init__(self, place: TrainerPlace) -> None:
        self.place = place
        self.members: dict[int, list[str]] = {}
        self.following: set[str] = set()
        self._dropped: dict[str, float] = {}  # peer -> DHT time it was left out
        self.convicted: set[str] = set()  # left out for wrong results (trainer.verify): never set up again
        self.epoch = 0  # bumped whenever a member comes or goes: the roster stage peers route by
        self.verifiers: frozenset[str] = frozenset()  # train.verifiers: members that take checks only

    def routable(self, record) -> bool:
        """Whether the trainer hands micro-batches to a record's peer: admitted to this session
        and, for stage 0 (the trainer's only neighbour), a member now."""
        place = self.place
        if not place.owner.routable(record, place.session):
            return False
        return record.stage != 0 or record.peer_id in self.members.get(0, [])

    def roster(self) -> pb.Roster:
        """The owner's signed word of who serves which stage now (micro-batches carry it)."""
        return self.place.owner.roster(self.place.session, self.epoch, self.members, self.verifiers)

    def serving(self, stage: int) -> list[str]:
        """The stage's members in service (not still catching up)."""
        return [peer for peer in self.members.get(stage, []) if peer not in self.following]

    def peers(self) -> list[tuple[int, str]]:
        """(stage, peer) of every member of the run."""
        return [(stage, peer) for stage in sorted(self.members) for peer in self.members[stage]]

    def start(self, members: dict[int, list[str]]) -> None:
        """A new setup: these members, none catching up."""
        self.members = {stage: list(peers) for stage, peers in members.items()}
        self.following.clear()
        self.epoch += 1

    def add(self, stage: int, peer: str, following: bool = False) -> None:
        self.members.setdefault(stage, []).append(peer)
        if following:
            self.following.add(peer)
        self.epoch += 1

    def withdraw(self, stage: int, peer: str) -> None:
        """`peer`'s setup as a joiner failed: out again, under a newer epoch (the roster its setup
        carried, which lists it, is outdated by every roster signed from now on)."""
        self.members[stage].remove(peer)
        self.following.discard(peer)
        self.epoch += 1

    def served(self, peer: str) -> None:
        """`peer` finished a micro-batch or an apply as a replica: it is in service."""
        self.following.discard(peer)

    def drop(self, stage: int, peer: str, why: str, left: bool = False) -> None:
        """`peer` is out of the run: it failed a round, or it `left` (drained, as it said it would)."""
        if peer in self.members.get(stage, []):
            self.members[stage].remove(peer)
            self.epoch += 1
        self.following.discard(peer)
        self._dropped[peer] = get_dht_time()
        level = logging.INFO if left else logging.WARNING
        self.place.events.add("leave", f"stage {stage}: peer {peer[-8:]} left the run ({why})", level, log)

    def convict(self, stage: int, peer: str, why: str) -> None:
        """`peer` computed wrong results: out of the run, and never set up again in this session."""
        self.convicted.add(peer)
        self.drop(stage, peer, why)

    async def candidates(self, stage: int, refresh: bool = True, ours: bool = False) -> list[str]:
        """Peers that announced themselves for `stage` and are not in the run (nor left it since);
        with `ours`, also those left out that still run this session (a restore sets them up again)."""
        place, found = self.place, []
        for record in await place.router.peers(stage, refresh=refresh):
            peer = record.peer_id
            if peer in self.members.get(stage, []) or record.leaving or (record.session == place.session and not ours):
                continue
            if place.router.bans.banned(peer) or record.updated <= self._dropped.get(peer, float("-inf")):
                continue
            if peer in self.convicted:
                continue
            found.append(peer)
        return found

    async def probe(self) -> None:
        """Members that do not answer, or no longer run this session, leave the run."""
        place = self.place
        for (stage, peer), status in (await place.statuses(self.peers(), place.settings.calls.info_timeout_s)).items():
            gone = isinstance(status, BaseException)
            if gone or not status.ready:
                place.router.failed(peer)
                self.drop(stage, peer, one_line(status) if gone else "it left the session")


class Position:
    """Where the run is: optimizer steps done, and of the current step the finished micro-batches'
    routes (index -> peer per stage) and what each was (to run again if a peer that ran it left)."""

    def __init__(self) -> None:
        self.step_index = 0
        self.routes: dict[int, list[str]] = {}
        self.sent: dict[int, tuple[MicroBatch, torch.Tensor]] = {}
        self.held: dict[tuple[int, str], bytes] = {}  # (index, peer) -> the attempt whose gradients it holds
        self.issued: dict[int, set[bytes]] = {}  # index -> every attempt of it sent in this step
        # (index, stage, peer) -> the exponents of the gradients it holds of that micro-batch (`grid`)
        self.reports: dict[tuple[int, int, str], bytes] = {}
        # the next step's micro-batches sent and finished before this step is done (an asynchronous
        # schedule starts them early): recorded when it begins, so no step counts another's
        self.early: list = []

    def issue(self, batch: MicroBatch) -> None:
        """An attempt of `batch` is sent (a stage holding another one holds a member's replay)."""
        if batch.step > self.step_index:
            self.early.append(lambda: self.issue(batch))
            return
        self.issued.setdefault(batch.index, set()).add(batch.attempt)

    def finished(
        self, batch: MicroBatch, inputs: torch.Tensor, route: list[str], counted: bool = True, exponents=()
    ) -> None:
        """`batch` came back through `route`, with its gradients' `exponents` per peer of it;
        `counted`: its gradients are the step's (else a verification's second run, whose peers hold
        its gradients now all the same)."""
        if batch.step > self.step_index:
            self.early.append(lambda: self.finished(batch, inputs, route, counted, exponents))
            return
        if counted:
            self.routes[batch.index] = list(route)
            self.sent[batch.index] = (batch, inputs)
        reports = list(exponents) if len(exponents) == len(route) else [b""] * len(route)
        for stage, (peer, report) in enumerate(zip(route, reports, strict=True)):
            self.held[(batch.index, peer)] = batch.attempt
            self.reports[(batch.index, stage, peer)] = report

    def grid(self, stage: int) -> bytes:
        """The step's grid of `stage`'s exact sum (exactsum `pack_grid`), merged from the reports of
        the gradients its peers hold of the micro-batches counted; empty unless every one came (its
        replicas then agree on the grid in a round of their own)."""
        reports = [self.reports.get((index, stage, route[stage]), b"") for index, route in self.routes.items()]
        size = len(reports[0]) // 2 if reports else 0
        codes = [unpack_codes(report, size) for report in reports]
        if not size or any(c is None for c in codes):
            return b""
        return pack_grid(*merged_codes(codes, size))

    def attempt(self, index: int, peer: str) -> bytes:
        """The attempt of micro-batch `index` whose gradients `peer` holds (the gather names it)."""
        return self.held.get((index, peer), self.sent[index][0].attempt)

    def next_step(self) -> None:
        early, self.early = self.early, []
        self.went_back(self.step_index + 1)
        for record in early:
            record()

    def went_back(self, step: int) -> None:
        self.step_index = step
        self.routes.clear()
        self.sent.clear()
        self.held.clear()
        self.issued.clear()
        self.reports.clear()
        self.early = []
