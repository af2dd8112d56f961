"""Setting stage peers up for the trainer's session: every peer at the start, a peer that joins at
a step boundary (it downloads its stage's state from the peers in service: stage.joining), a peer
that takes over a stage that lost its last one (trainer.recovery).

With an asynchronous schedule (swarm.engine.delay) a joiner is admitted only where the pipeline
drained (`boundary`; the loop drains for one that waits: `waiting`), and the run waits until it
serves: what it downloads is then the whole stage, its last step's gradients held unapplied
included (and a delay correction's per-step weights: StageState.saved), and it misses no round nor
decision while it catches up (it follows none)."""

from __future__ import annotations

import asyncio
import logging
import time

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.stubs import STUBS
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.routing.router import NoPeerError
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace

log = logging.getLogger(__name__)
# The owner's roster rides in every micro-batch's head (64 KiB at most, stage.server.MAX_HEAD_BYTES):
# 1,024 members make a head of 52.6 KiB with every other field it may carry.
MAX_MEMBERS = 1024
TELL_AFTER_S = 3.0  # a trainer still waiting for a stage's peer after this says so (once)


class Setups:
    """`digest`: of the config fields a stage depends on (a stage with another refuses the setup)."""

    def __init__(
        self, place: TrainerPlace, membership: Membership, position: Position, digest: str, train=None
    ) -> None:
        self.place, self.membership, self.position, self.digest = place, membership, position, digest
        self.args: tuple[int, int] = (0, 0)  # (lr horizon, capacity) every setup carries
        # asynchronous: joiners only where the pipeline drained, in service before it goes on
        self.drained = train is not None and train.schedule == "async"

    async def set_up(self, stage: int, peer_id: str, sources: list[str] = ()) -> pb.SetupReply:
        place = self.place
        lr_horizon, capacity = self.args
        request = STUBS.setup(
            to=address(place.run_id, stage),
            config_digest=self.digest,
            lr_horizon=lr_horizon,
            capacity=capacity,
            session=place.session,
            sources=sources,
            admission=place.owner.admit(place.session, peer_id, stage),
            check_key=place.owner.check_keys.of(place.session, peer_id),
        )
        if peer_id in self.membership.members.get(stage, []):  # its sources check the roster lists it
            request.head.roster.CopyFrom(self.membership.roster())
        timeout = place.settings.calls.call_timeout_s  # setups are idempotent (one session builds once)
        frame = await place.retry.same_peer(
            lambda: ask(place.node.streams, peer_id, request, timeout, owner=place.owner.key),
            f"setup of stage {stage} peer {peer_id[-8:]}",
        )
        return frame.head

    def first_few(self, records: list) -> list:
        """Of a stage's records at the session's start, those it takes: at most `max_peers_per_stage`,
        and its share of `MAX_MEMBERS` (a flood of records must not make the roster outgrow a head)."""
        limit = min(self.place.settings.limits.max_peers_per_stage, MAX_MEMBERS // self.place.num_stages)
        return list(records)[:limit]

    async def records(self, router, stages, deadline: float, wait_s: float, gone=frozenset()) -> dict[int, list]:
        """Waits (until `deadline`) until each of `stages` has a peer on the DHT that is not leaving
        and not `gone`; the first few of each (`first_few`)."""
        started, told = time.monotonic(), False
        while True:
            found = {}
            for stage in stages:
                records = await router.peers(stage, refresh=True)
                found[stage] = self.first_few([r for r in records if not r.leaving and r.peer_id not in gone])
            missing = [s for s, records in found.items() if not records]
            if not missing:
                return found
            run_id = self.place.run_id
            if time.monotonic() > deadline:
                raise NoPeerError(
                    f"no peer serves stage(s) {', '.join(map(str, missing))} of run {run_id!r} after {wait_s:.0f}s (start them with python -m peers.stage --stage N --run_id {run_id})"
                )
            if not told and time.monotonic() - started > TELL_AFTER_S:  # a lookup at the start may lag
                log.warning("waiting for a peer of stage(s) %s of run %r (at most %.0fs)", missing, run_id, wait_s)
                told = True
            await asyncio.sleep(0.5)

    async def first(self, router, found: dict[int, list], deadline: float, wait_s: float):
        """Sets up the peers `found` (stage -> records) for the session: (stage -> peers set up, the
        tied weights one reported). A stage whose every peer fails its setup (gone, its record not
        yet expired) waits for another until `deadline` instead of ending the run at its start."""
        members: dict[int, list[str]] = {}
        tied: list = []
        gone: set[str] = set()

        async def one(stage: int, peer_id: str):
            try:
                return stage, peer_id, await self.set_up(stage, peer_id)
            except TransportError as e:
                return stage, peer_id, e

        while True:
            replies = await asyncio.gather(*(one(s, r.peer_id) for s, records in found.items() for r in records))
            for stage, peer_id, reply in replies:
                if isinstance(reply, TransportError):
                    gone.add(peer_id)
                    router.failed(peer_id)
                    log.warning("stage %d peer %s left out: %s", stage, peer_id[-8:], one_line(reply))
                    continue
                members.setdefault(stage, []).append(peer_id)
                tied = tied or list(reply.tied)
            lacking = [s for s in found if s not in members]
            if not lacking:
                return {stage: members[stage] for stage in sorted(members)}, tied
            found = await self.records(router, lacking, deadline, wait_s, gone)

    def _room(self, stage: int) -> int:
        """How many new peers `stage` takes at this step boundary (settings.limits)."""
        limits, members = self.place.settings.limits, self.membership.members.get(stage, [])
        joining = sum(peer in self.membership.following for peer in members)
        total = len(self.membership.peers())
        room = min(limits.joins_per_step, limits.max_joining - joining, limits.max_peers_per_stage - len(members))
        return max(0, min(room, MAX_MEMBERS - total))

    async def admit(self, settle=None) -> list[tuple[int, str]]:
        """At a step boundary: sets up the peers that announced themselves for a stage with a peer in
        service since the last look (the router's cached view), as joiners; those admitted. Before
        the first is set up, `settle()` (every stage applies the last step: joiners download it)."""
        place, membership = self.place, self.membership
        admitted = []
        for stage in range(place.num_stages):
            sources = membership.serving(stage)
            if not sources:
                continue
            candidates = await membership.candidates(stage, refresh=False)
            room = self._room(stage)
            if len(candidates) > room:
                log.info("stage %d: %d peer(s) wait to join (admission limits)", stage, len(candidates) - room)
            for peer in candidates[:room]:
                if settle is not None:
                    await settle()
                membership.add(stage, peer, following=True)  # first: the roster its setup carries lists it
                try:
                    await self.set_up(stage, peer, sources)
                except (TransportError, RemoteError) as e:
                    membership.withdraw(stage, peer)
                    place.router.failed(peer)
                    log.warning("stage %d peer %s could not join: %s", stage, peer[-8:], one_line(e))
                    continue
                admitted.append((stage, peer))
                step = self.position.step_index
                place.events.add("join", f"stage {stage}: peer {peer[-8:]} joins at step {step}", logger=log)
        return admitted

    async def boundary(self, settle, drained: bool) -> None:
        """At a step boundary (`drained`: no micro-batch of the next step went out yet): `admit`;
        where joiners wait for a drained pipeline, only there, each then waited for until it serves."""
        if not self.drained:
            await self.admit(settle=settle)
        elif drained:
            for stage, peer in await self.admit(settle=settle):
                await self._serving(stage, peer)

    async def waiting(self) -> bool:
        """Whether a peer waits to be admitted where the pipeline drains (the loop drains for it)."""
        if not self.drained:
            return False
        for stage in range(self.place.num_stages):
            if self.membership.serving(stage) and self._room(stage):
                if await self.membership.candidates(stage, refresh=False):
                    return True
        return False

    async def _serving(self, stage: int, peer: str) -> None:
        """Until the joiner installed its state and serves; one that fails or gives up is left out."""
        place, membership = self.place, self.membership
        deadline = time.monotonic() + place.settings.calls.state_timeout_s
        while True:
            status = (await place.statuses([(stage, peer)], place.settings.calls.info_timeout_s))[(stage, peer)]
            if not isinstance(status, BaseException) and status.role == "serving":
                membership.served(peer)
                return
            gone = isinstance(status, BaseException) or status.role != "following"
            if gone or time.monotonic() > deadline:
                place.router.failed(peer)
                why = one_line(status) if isinstance(status, BaseException) else f"it is {status.role}"
                membership.drop(stage, peer, f"its join did not finish ({why})")
                return
            await asyncio.sleep(0.1)
