"""The trainer's side of the swarm's copies (swarm.transport.hivemind.stage.snapshots): a snapshot
round every few steps, and going back to the newest complete set of copies when a stage lost its
last peer or when a new trainer takes over a run whose stages are still there.

Every `every` steps each stage peer in service keeps a copy of its state with the trainer's position,
and the first `HOLDERS` peers of the next stage (stage 0's, for the last stage) fetch a copy of it.
A micro-batch or round that fails with a stage left without a peer in service pauses the run: the
trainer says which stage lacks a peer and how to start one, waits for one to announce itself, sets
it up, and restores every stage to the newest step of which the swarm holds a copy of every stage;
the training loop then replays the steps since from its deterministic data order
(swarm.engine.pipeline.Rewound), so the run ends as if nothing had happened.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.stubs import STUBS
from protocols.wire_names import OUTRUN
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address
from swarm.transport.hivemind.trainer.adaptive import AdaptiveCodecs
from swarm.transport.hivemind.trainer.copies import (
    Held,
    History,
    fetch_seconds,
    held_named,
    named_of,
    newest_complete,
    shown_manifests,
)
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace
from swarm.transport.hivemind.trainer.rounds import SwarmRounds
from swarm.transport.hivemind.trust import manifests

log = logging.getLogger(__name__)
HOLDERS = 2  # peers of the next stage that fetch a stage's copy
REMIND_S = 60.0  # a paused run says again what it waits for this often


@dataclass(frozen=True)
class RecoveryHooks:
    """What recovery asks of the trainer: `set_up(stage, peer)` sets a peer up for the session (a new
    one, or one that left it); `went_back(step)`: every stage is at `step`."""

    set_up: Callable[[int, str], Awaitable[object]]
    went_back: Callable[[int], Awaitable[None]]


class Recovery:
    """Snapshot rounds and restores; `every` 0 keeps no copies."""

    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        position: Position,
        rounds: SwarmRounds,
        adaptive: AdaptiveCodecs | None,
        hooks: RecoveryHooks,
        every: int,
    ) -> None:
        self.place, self.membership, self.position, self.rounds, self.adaptive = (
            place,
            membership,
            position,
            rounds,
            adaptive,
        )
        self.set_up, self.went_back = hooks.set_up, hooks.went_back
        self.every = every
        self.paused: str | None = None  # why the run waits, while it does (its progress record says it)
        self.lineage = place.session
        self.taken: int | None = None  # the step of the last snapshot round
        # no round before the last one's copies have arrived at their holders (paced copies on a slow
        # link take longer than `every` steps: flow.background); decided once per step, so the
        # loop's drain and the round agree
        self.fetched_by = 0.0
        self._ready: tuple[int, bool] = (-1, True)
        self.kept = False  # the swarm holds copies of this lineage (a snapshot round went through)
        self.outrun: set[int] = set()  # steps replayed for a micro-batch sent again too late (since the last copies)
        self.history = History()
        # (lineage, step) -> stage -> what the owner's manifest names of its copies: only those are
        # restored (stage peers keep the signed manifests; a new trainer reads them there)
        self.accepted: dict[tuple[str, int], dict[int, manifests.Named]] = {}

    # ---- snapshots ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the swarm keeps copies at `step`."""
        if not self.every or step % self.every or self.taken == step:
            return False
        if self._ready[0] != step:
            self._ready = (step, time.monotonic() >= self.fetched_by)
        return self._ready[1]

    async def snapshot(self, step: int, position: dict) -> None:
        """Every `every` steps: each peer in service keeps a copy of its stage at `step` with the
        trainer's `position`, and the next stage's first peers fetch one."""
        place, membership, rounds = self.place, self.membership, self.rounds
        if not self.due(step):
            return
        if self.taken is not None and place.num_stages > 1:  # the holders fetched the last round's copies
            held = [c for c in self._copies(await self._ask(membership.peers())) if c.hosted != c.stage]
            complete = newest_complete(held, place.num_stages, self.lineage)  # copies off each stage's own peers
            if complete is None or complete[1] != self.taken:
                log.warning(
                    "the swarm holds no complete set of copies of step %d away from their stages (the newest: %s): a holder's fetch failed or is still running",
                    self.taken,
                    "none" if complete is None else f"step {complete[1]}",
                )
        # with the history of pauses and restarts (a new trainer carries it on) and adaptive
        # compression's codecs of that step (and how it got there)
        position = {
            **position,
            "recovery": json.dumps({"pauses": self.history.pauses, "restarts": self.history.restarts}),
        }
        if self.adaptive is not None:
            position["adaptive"] = self.adaptive.saved()
        buffer = io.BytesIO()
        torch.save(position, buffer)
        orders: dict[str, list[pb.HoldOrder]] = defaultdict(list)
        serving = membership.serving
        for stage in range(place.num_stages):
            holding = (stage + 1) % place.num_stages
            if holding != stage:
                for peer in serving(holding)[:HOLDERS]:
                    orders[peer].append(pb.HoldOrder(stage=stage, sources=serving(stage)))
        peers = [(s, peer) for s in range(place.num_stages) for peer in serving(s)]

        async def one(stage: int, peer: str, hold: list[pb.HoldOrder]):
            fields = {"step": step, "lineage": self.lineage, "hold": hold}
            return await rounds.call(stage, peer, STUBS.snapshot, buffer.getvalue(), **fields)

        # every peer takes its copy, then the holders fetch theirs (a copy not yet taken cannot be fetched)
        started = time.monotonic()
        try:
            taken = await rounds.every(peers, lambda s, peer: one(s, peer, []))
            self.history.copy_bytes.update({stage: int(frame.head.bytes) for (stage, _), frame in taken.items()})
            named = self._named(step, peers, taken)
            self.accepted[(self.lineage, step)] = named
            for hold in orders.values():
                for order in hold:
                    agreed = named.get(int(order.stage), manifests.Named())
                    order.accepted.extend(sorted(agreed.copies))
                    order.weights_sha256 = agreed.weights
            holders = [(s, peer) for s, peer in peers if peer in orders]
            await rounds.every(holders, lambda s, peer: one(s, peer, orders[peer]))
            fetching = defaultdict(int)  # stage -> holders fetching its copy
            for hold in orders.values():
                for order in hold:
                    fetching[int(order.stage)] += 1
            firsts = {s: serving(s)[0] for s in fetching if serving(s)}
            self.fetched_by = time.monotonic() + fetch_seconds(taken, fetching, firsts)
            await self._publish(step, named, peers)
        except (TransportError, RemoteError) as e:  # the copies are bookkeeping: only a lost stage stops the run
            await membership.probe()
            if not all(serving(s) for s in range(place.num_stages)):
                raise
            log.warning("step %d: the swarm's copies of this step are incomplete: %s", step, one_line(e))
            return
        self.history.rounds_s += time.monotonic() - started
        self.taken, self.kept = step, True
        self.outrun = {s for s in self.outrun if s >= step}  # replays behind the newest copies are done
        self.history.rounds += 1

    def _named(self, step: int, peers: list[tuple[int, str]], taken: dict) -> dict[int, manifests.Named]:
        """Per stage, the copies of the round the manifest names: those of the peers that report the
        weights most of the stage's peers report (`peers` in admission order)."""
        named = {}
        for stage in range(self.place.num_stages):
            reports = [
                (peer, bytes(taken[(s, peer)].head.sha256), bytes(taken[(s, peer)].head.weights_sha256))
                for s, peer in peers
                if s == stage and (s, peer) in taken
            ]
            if not reports:
                continue
            named[stage], outvoted = manifests.agreed(reports)
            for peer in outvoted:
                self.place.events.add(
                    "refuse",
                    f"stage {stage}: peer {peer[-8:]}'s copy of step {step} holds weights its stage's other peers do not: it is never restored",
                    logging.WARNING,
                    log,
                )
        return named

    async def _publish(self, step: int, named: dict[int, manifests.Named], peers: list[tuple[int, str]]) -> None:
        """Every peer of the round keeps the owner's signed manifest of its copies (a peer that misses
        it costs nothing now: a new trainer would restore an older step whose manifest it has)."""
        place = self.place
        manifest = manifests.make(place.owner.key, place.run_id, self.lineage, step, named)
        await asyncio.gather(
            *(
                self.rounds.call(s, peer, STUBS.snapshot, step=step, lineage=self.lineage, manifest=manifest)
                for s, peer in peers
            ),
            return_exceptions=True,
        )
        for key in sorted(self.accepted, key=lambda key: key[1])[: -manifests.KEEP]:
            del self.accepted[key]

    def notes(self) -> dict:
        """The summary row's account: copies taken, their cost and size, and the pauses."""
        if not self.every:
            return {}
        history = self.history
        copies = {
            "every": self.every,
            "rounds": history.rounds,
            "seconds": history.rounds_s,
            "bytes": history.copy_bytes,
        }
        return {"copies": copies, "pauses": history.pauses, "restarts": history.restarts}

    def took_over(self, position: dict, step: int) -> None:
        """A new trainer resumed at `step`: the run's history so far goes on."""
        kept = json.loads(position.get("recovery", "{}"))
        self.history.pauses = list(kept.get("pauses", []))
        self.history.restarts = [*kept.get("restarts", []), {"to_step": step}]

    async def discard(self) -> None:
        """The run finished: its copies go (a later trainer of the run id starts afresh)."""
        place = self.place
        if not self.every:
            return
        timeout = place.settings.calls.info_timeout_s  # once each, briefly: a peer gone keeps nothing anyway

        async def one(stage: int, peer: str):
            request = STUBS.snapshot(to=address(place.run_id, stage), discard=True, lineage=self.lineage)
            return await ask(place.node.streams, peer, request, timeout, owner=place.owner.key)

        await asyncio.gather(*(one(s, peer) for s, peer in self.membership.peers()), return_exceptions=True)

    # ---- what the swarm holds ------------------------------------------------------------------

    async def _ask(self, peers: list[tuple[int, str]]) -> dict[tuple[int, str], object]:
        """Each peer's status of the stage it hosts for this run (an exception: it did not answer)."""
        return await self.place.statuses(peers, self.place.settings.calls.info_timeout_s)

    def _copies(self, statuses) -> list[Held]:
        """The copies the peers say they keep, of those the owner's manifests name (ours, and those
        the peers keep, signed by our key): a copy no manifest names is never restored."""
        for key, stages in shown_manifests(statuses, self.place.owner.peer_id, self.place.run_id).items():
            self.accepted.setdefault(key, stages)
        return held_named(statuses, self.accepted)

    def _named_of(self, lineage: str, step: int, stage: int) -> manifests.Named:
        return named_of(self.accepted, lineage, step, stage)

    async def resume_point(self, found: dict[int, list[str]]):
        """A new trainer's look at the stage peers `found`: the newest step of which they hold a
        copy of every stage, as `newest_complete` gives it, or None (the run starts afresh)."""
        if not self.every:
            return None
        statuses = await self._ask([(s, peer) for s, peers in found.items() for peer in peers])
        return newest_complete(self._copies(statuses), self.place.num_stages)

    # ---- a lost stage ----------------------------------------------------------------------------

    async def recover(self, error: BaseException) -> dict | None:
        """After `error` in a micro-batch or round: if a stage has no peer in service left, pauses
        until every stage has a peer, restores the newest complete copies and returns the trainer's
        position kept with them; None when every stage still serves (the error is not ours to mend).
        An asynchronous step whose micro-batch was sent again too late (`OUTRUN`: its stages' weights
        serve the next step already) goes back to the copies too, once per step."""
        place, membership = self.place, self.membership
        if not self.every or not self.kept:
            return None
        await membership.probe()
        started, at = time.monotonic(), self.position.step_index
        if all(membership.serving(s) for s in range(place.num_stages)):
            if OUTRUN not in str(error) or at in self.outrun:  # once a step: twice is no race
                return None
            self.outrun.add(at)
            self.paused = (
                f"paused at step {at}: a micro-batch of it was sent again after the next step's moved the weights on"
            )
        else:
            lacking = ", ".join(str(s) for s in range(place.num_stages) if not membership.serving(s))
            self.paused = f"paused at step {at}: stage {lacking} has no peer in service"
        place.events.add("pause", f"{self.paused} ({one_line(error)})", logging.WARNING, log)
        while True:
            await self._wait_for_peers(at)
            choice = newest_complete(self._copies(await self._ask(membership.peers())), place.num_stages, self.lineage)
            if choice is None:
                raise RuntimeError(
                    f"the swarm holds no complete set of copies of run {place.run_id!r} (a stage and the peers holding its copies were lost together): restart from a checkpoint (--checkpoint_dir)"
                )
            _, step, sources = choice
            position = await self.restore(step, sources, time.monotonic() - started)
            if position is not None:
                break
        paused = time.monotonic() - started
        self.history.pauses.append({"from_step": at, "to_step": step, "paused_s": paused})
        text = f"run resumed after {paused:.1f}s: every stage went back to step {step}, replaying {at - step} step(s)"
        place.events.add("resume", text, logging.WARNING, log)
        self.paused = None
        return position

    async def _wait_for_peers(self, at: int) -> None:
        """Until every stage has a member: stages without one take the first peer that announces itself."""
        place, membership = self.place, self.membership
        said = 0.0
        while empty := [s for s in range(place.num_stages) if not membership.members.get(s)]:
            if time.monotonic() - said > REMIND_S:
                said = time.monotonic()
                for stage in empty:
                    log.warning(
                        "run %r paused at step %d: stage %d has no peer; start one to go on: python -m peers.stage --stage %d --run_id %s --initial_peers ...",
                        place.run_id,
                        at,
                        stage,
                        stage,
                        place.run_id,
                    )
            for stage in empty:
                for peer in await membership.candidates(stage, ours=True):
                    try:
                        await self.set_up(stage, peer)
                    except (TransportError, RemoteError) as e:
                        place.router.failed(peer)
                        log.warning("stage %d peer %s could not be set up: %s", stage, peer[-8:], one_line(e))
                        continue
                    membership.add(stage, peer)
                    log.info("stage %d: peer %s takes over", stage, peer[-8:])
                    break
            await asyncio.sleep(0.5)

    async def restore(self, step: int, sources: dict[int, list[tuple[str, int]]], paused_s: float = 0.0) -> dict | None:
        """Every member goes back to the copies of `step`; the trainer's position kept with them, or
        None if a stage lost every member meanwhile (those that failed leave the run)."""
        place, membership = self.place, self.membership
        members = membership.peers()

        async def one(stage: int, peer: str):
            await self.set_up(stage, peer)  # a peer that left the session is built again (else a no-op)
            given = [pb.SnapshotSource(peer_id=other, stage=hosted) for other, hosted in sources.get(stage, [])]
            named = self._named_of(self.lineage, step, stage)
            # a peer without the copy tries the sources in turn, each for up to state_timeout_s
            timeout = place.settings.calls.state_timeout_s * max(1, len(given)) + place.settings.calls.call_timeout_s
            return await self.rounds.call(
                stage,
                peer,
                STUBS.restore,
                timeout=timeout,
                step=step,
                lineage=self.lineage,
                sources=given,
                paused_s=paused_s,
                accepted=sorted(named.copies),
                weights_sha256=named.weights,
            )

        replies = await asyncio.gather(*(one(s, peer) for s, peer in members), return_exceptions=True)
        position = None
        for (stage, peer), reply in zip(members, replies, strict=True):
            if isinstance(reply, TransportError | RemoteError):
                place.router.failed(peer)
                membership.drop(stage, peer, f"its restore failed: {one_line(reply)}")
            elif isinstance(reply, BaseException):
                raise reply
            else:  # it just went back to the copies: failures before the pause (often another peer's) are forgiven
                place.router.succeeded(peer)
                if position is None and reply.payload:
                    position = torch.load(io.BytesIO(reply.payload), weights_only=True)
        if not all(membership.members.get(s) for s in range(place.num_stages)):
            return None
        if position is None:
            raise RuntimeError(f"the copies of step {step} carry no trainer position")
        if self.adaptive is not None and "adaptive" in position:  # the codecs go back with the copies
            self.adaptive.restore_saved(position["adaptive"])
        try:
            await self.went_back(step)  # an asynchronous run's last decision is made again: a round
        except (TransportError, RemoteError) as e:  # a peer failed it: gone ones leave, the restore starts over
            place.events.add("pause", f"going back to step {step} failed: {one_line(e)}", logging.WARNING, log)
            await membership.probe()
            return None
        self.taken, self.kept = None, True  # the next round at `step` has new holders fetch their copies
        self.fetched_by = 0.0
        return position
