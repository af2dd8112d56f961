"""The synchronous step (swarm.engine.step) and checkpoints over the stage peers: each round sent to
every peer set up for the run, each retried on its peer when a reply is lost (rounds are
idempotent there: swarm.transport.hivemind.stage.rounds).

Gathering is where membership meets the step: every peer sums the gradients of the micro-batches
that finished through it (its held gradients of failed attempts never count), then sums them with
the peers that share them, in groups the trainer names (swarm.transport.hivemind.stage.combine):
a replicated stage's peers, those still joining too (they take the sum without adding to it), and
a tied parameter's two stages. Gradients never pass through the trainer. A peer that left with
micro-batches of this step makes those run again through the peers still there, and the round goes
again with new groups; a peer whose group lost a member answers GROUP_FAILED and stays. A peer
that fails a later round is left out of the run while its stage has another peer in service: the
sum it would have applied is the same everywhere, so the others go on without it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from protocols import stage_pb2 as pb
from protocols.errors import RemoteError, TransportError, one_line
from protocols.framing import Frame
from protocols.stubs import STUBS, Stub
from protocols.wire_names import OUTRUN
from swarm.engine.checkpoint import CODECS_FILE, atomic_write, checkpoint_codecs, stage_file
from swarm.engine.step import Grads
from swarm.tracing import TRACER
from swarm.transport.hivemind.net.calls import ask
from swarm.transport.hivemind.net.meta import address, tensors_to_payload
from swarm.transport.hivemind.trainer.adaptive import AdaptiveCodecs
from swarm.transport.hivemind.trainer.blame import blamed_members
from swarm.transport.hivemind.trainer.membership import Membership, Position, TrainerPlace

log = logging.getLogger(__name__)


@dataclass
class StepHooks:
    """What the step's rounds ask of the trainer: run micro-batches of this step again (their peer
    left), the codecs that change with this step (adaptive compression), and the step is done."""

    run_again: Callable[[list[int]], Awaitable[None]]
    codecs: Callable[[], Awaitable[list[pb.BoundaryCodecs]]]
    step_done: Callable[[], None]


class SwarmRounds:
    """The step's rounds over the run's members, as `swarm.engine.step.StepRounds`."""

    def __init__(
        self,
        place: TrainerPlace,
        membership: Membership,
        position: Position,
        adaptive: AdaptiveCodecs | None,
        hooks: StepHooks,
    ) -> None:
        self.place, self.membership, self.position, self.adaptive, self.hooks = (
            place,
            membership,
            position,
            adaptive,
            hooks,
        )
        self.payload_bytes: Counter = Counter()  # of the rounds, by kind and direction ("gather.sent")
        self.calls: Counter = Counter()  # rounds' calls answered, by kind

    async def call(
        self, stage: int, peer_id: str, stub: Stub, payload: bytes = b"", timeout: float | None = None, **fields
    ) -> Frame:
        """One round on one peer (`fields`: its head's, but its address), retried there when its reply is lost."""
        place = self.place
        request = stub(to=address(place.run_id, stage), **fields)
        timeout = timeout or place.settings.calls.call_timeout_s
        frame = await place.retry.same_peer(
            lambda: ask(place.node.streams, peer_id, request, timeout, payload, place.owner.key),
            f"{stub.kind} round on stage {stage} peer {peer_id[-8:]}",
        )
        self._tally(stub.kind, payload, frame)
        return frame

    def _tally(self, kind: str, sent: bytes, reply: Frame) -> None:
        self.calls[kind] += 1
        self.payload_bytes[f"{kind}.sent"] += len(sent)
        self.payload_bytes[f"{kind}.received"] += len(reply.payload)

    async def every(self, peers: list[tuple[int, str]], one) -> dict[tuple[int, str], Frame]:
        """`one(stage, peer)` on every peer at once; the replies of those that answered. A peer that
        failed is left out of the run, unless its stage has no other peer in service."""
        replies = await asyncio.gather(*(one(s, peer) for s, peer in peers), return_exceptions=True)
        answered = {}
        for (stage, peer), reply in zip(peers, replies, strict=True):
            if not isinstance(reply, BaseException):
                answered[(stage, peer)] = reply
                continue
            if not isinstance(reply, TransportError | RemoteError):
                raise reply
            if not [other for other in self.membership.serving(stage) if other != peer]:
                raise reply
            self.place.router.failed(peer)
            self.membership.drop(stage, peer, one_line(reply))
        return answered

    def replicated(self, stage: int) -> bool:
        return False  # replicas sum their gradients among themselves in the gather round

    # ---- round 1: gather ------------------------------------------------------------------------

    def gather(self, wanted: dict[int, list[str]]) -> Grads:
        """Every peer sums its micro-batches' gradients, then with the peers that share them: the
        stage's replicas, and for a tied parameter (`wanted`) both stages' peers. Nothing comes
        back here: the trainer's traffic is the round itself."""
        with TRACER.span("gather", "step"):
            self.place.loop.run(self._gather())
        return {}

    def groups(
        self, peers: list[tuple[int, str]], held: bool = False, replicas: bool = True
    ) -> dict[tuple[int, str], list[pb.AverageGroup]]:
        """Each (stage, peer)'s averaging groups for one attempt of the step's gather round (ids of
        their own: a retry, or the same step replayed after a restore, never meets an old group).
        `held`: a stage's peers all hold the stage's whole sum when the tied groups run (stage.combine:
        their replicas' exact sum comes first), so one peer per stage contributes to them;
        without `replicas` (every peer holds the whole step already) only the tied groups."""
        by_stage: dict[int, list[str]] = defaultdict(list)
        for stage, peer in peers:
            by_stage[stage].append(peer)
        prefix = f"{self.place.run_id}/{self.position.step_index}/{uuid.uuid4().hex[:12]}"
        groups: dict[tuple[int, str], list[pb.AverageGroup]] = defaultdict(list)
        following = set(self.membership.following)
        if held:  # the first peer of each stage in service brings its stage's whole; the others receive
            following |= {
                peer for members in by_stage.values() for peer in [p for p in members if p not in following][1:]
            }

        def add(group_id: str, members: list[str], stage: int, names=(), counted=False, grid=b"") -> None:
            receivers = [peer for peer in members if peer in (following if names else self.membership.following)]
            if len(members) < 2 or len(receivers) == len(members):
                return
            if len(set(members)) < len(members):
                raise ValueError(
                    f"a peer hosts both stages of a tied parameter ({', '.join(names)}): run them as separate peers"
                )
            group = pb.AverageGroup(
                group_id=group_id.encode(), peers=members, receivers=receivers, names=names, counted=counted, grid=grid
            )
            for peer in by_stage[stage]:
                groups[(stage, peer)].append(group)

        for stage, members in by_stage.items():
            if replicas:  # the step's grid goes with it: no round of their own to agree on one
                add(f"{prefix}/stage{stage}", members, stage, grid=self.position.grid(stage))
        for i, pair in enumerate(self.place.tied):
            (first, first_name), (second, second_name) = pair.first, pair.second
            if first != second:
                members = by_stage[first] + by_stage[second]
                add(f"{prefix}/tied{i}", members, first, [first_name], True)
                add(f"{prefix}/tied{i}", members, second, [second_name], False)
        return groups

    def counted(self) -> dict[tuple[int, str], list[int]]:
        """(stage, peer) -> the step's micro-batches whose gradients count there (their last route)."""
        counted: dict[tuple[int, str], list[int]] = defaultdict(list)
        for index, route in self.position.routes.items():
            for stage, peer in enumerate(route):
                counted[(stage, peer)].append(index)
        return counted

    async def gather_on(
        self,
        stage: int,
        peer: str,
        indices: list[int],
        groups: list[pb.AverageGroup],
        held: bool = False,
        earlier: int | None = None,
    ) -> Frame:
        """Not retried on the peer: its groups are of this attempt only (the next has new ones). Its
        time: the all-reduce's (call_timeout_s) and the computing around it. `held`: the asynchronous
        form, which sums the held gradients without setting them (swarm.transport.hivemind.stage.combine).
        `earlier`: an earlier step than the one under way (restored, or dc's step before), whose
        micro-batches every peer holds: checked by presence, as `held` checks them, not by attempt."""
        place = self.place
        indices = sorted(indices)
        attempts = [self.position.attempt(i, peer) for i in indices] if earlier is None else []  # only these count
        request = STUBS.gather(
            to=address(place.run_id, stage),
            step=self.position.step_index if earlier is None else earlier,
            micro_batches=indices,
            groups=groups,
            attempts=attempts,
            held=held,
        )
        timeout = 1.5 * place.settings.calls.call_timeout_s + place.settings.calls.reply_grace_s
        frame = await ask(place.node.streams, peer, request, timeout, owner=place.owner.key)
        self._tally(request.kind, b"", frame)
        return frame

    async def _gather(self) -> None:
        place, membership, position = self.place, self.membership, self.position
        for attempt in range(place.settings.retries.attempts):
            counted = self.counted()
            peers = membership.peers()
            groups = self.groups(peers, held=True)  # a tied group adds each stage's whole: its replicas' exact sum
            replies = await asyncio.gather(
                *(self.gather_on(s, peer, counted.get((s, peer), []), groups.get((s, peer), [])) for s, peer in peers),
                return_exceptions=True,
            )
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, TransportError | RemoteError):
                    raise reply
            failed = [(s, peer, r) for (s, peer), r in zip(peers, replies, strict=True) if isinstance(r, BaseException)]
            if not failed:
                return
            # a peer whose group lost a member is fine itself, and so is one that holds stale
            # gradients of some micro-batches (a member replayed them): only the others leave
            kept = (pb.GROUP_FAILED, pb.STALE)
            lost = [(s, peer, e) for s, peer, e in failed if not (isinstance(e, RemoteError) and e.code in kept)]
            reports = [(s, e.stale) for s, _, e in failed if isinstance(e, RemoteError) and e.code == pb.STALE]
            stale = {report.index for _, found in reports for report in found}
            self._leave_out_replayers(reports)
            for stage, peer, error in lost:
                if not [other for other in membership.serving(stage) if other != peer]:
                    raise error
                place.router.failed(peer)
                membership.drop(stage, peer, f"{one_line(error)}; its micro-batches run again")
            if not lost and not stale and not self.leave_out_blamed(peers, replies):
                await membership.probe()  # nobody named: a member that does not answer leaves
            rerun = sorted(
                i
                for i, route in position.routes.items()
                if i in stale or any(peer not in membership.members.get(s, []) for s, peer in enumerate(route))
            )
            if rerun:
                await self.hooks.run_again(rerun)
            await asyncio.sleep(place.settings.retries.backoff_s * (attempt + 1))
        raise TransportError(f"step {position.step_index}: the gather round kept failing ({one_line(failed[0][2])})")

    def _leave_out_replayers(self, reports: list[tuple[int, list[pb.StaleMicroBatch]]]) -> None:
        """A stage holding an attempt of a micro-batch the owner never sent holds a replay: its
        sender (a member of the stage before) is left out for good, while its stage keeps a peer."""
        issued, membership = self.position.issued, self.membership
        for stage, found in reports:
            for report in found:
                sender = report.sender
                if not report.held or report.held in issued.get(report.index, ()) or stage == 0:
                    continue
                if sender in membership.members.get(stage - 1, []) and [
                    p for p in membership.serving(stage - 1) if p != sender
                ]:
                    self.place.router.failed(sender)
                    why = f"it sent stage {stage} micro-batch {report.index} of step {self.position.step_index} under an attempt the owner never made (a replay)"
                    membership.convict(stage - 1, sender, why)

    def leave_out_blamed(self, peers: list[tuple[int, str]], replies: list) -> bool:
        """Only groups failed: the members they failed on leave the run (trainer.blame). Whether any left."""
        membership = self.membership
        left = blamed_members(peers, replies, membership.members, membership.serving)
        for stage, peer, why in left:
            self.place.router.failed(peer)
            membership.drop(stage, peer, why)
        return bool(left)

    # ---- round 2: set the combined gradients, read the norm ---------------------------------------

    def set_gradients(self, grads: Grads, norm: bool) -> float:
        membership, step = self.membership, self.position.step_index
        payloads = {stage: tensors_to_payload(stage_grads) for stage, stage_grads in grads.items()}

        async def one(stage: int, peer: str, with_norm: bool = False) -> Frame:
            slots, data = payloads.get(stage, ([], b""))
            return await self.call(stage, peer, STUBS.set_grads, data, step=step, grads=slots, norm=with_norm)

        async def run() -> float:
            # replicas hold the same sum: one norm per stage, from a peer in service
            serving = membership.serving
            asked = {(stage, serving(stage)[0]) for stage in membership.members if norm and serving(stage)}
            answered = await self.every(membership.peers(), lambda s, peer: one(s, peer, (s, peer) in asked))
            total = 0.0
            for stage in sorted({s for s, _ in asked}):
                frames = [frame for key, frame in answered.items() if key in asked and key[0] == stage]
                if not frames:  # the peer asked left: another in service has the same sum
                    again = await self.every([(stage, serving(stage)[0])], partial(one, with_norm=True))
                    frames = list(again.values())
                total += frames[0].head.grad_sq_norm
            return total

        with TRACER.span("set_grads", "step"):
            return self.place.loop.run(run())

    # ---- round 3: apply -------------------------------------------------------------------------

    def apply(self, scale: float) -> float:
        async def run() -> float:
            return await self.applied(self.position.step_index, scale, await self.hooks.codecs())

        with TRACER.span("apply", "step"):
            lr = self.place.loop.run(run())
        self.hooks.step_done()
        return lr

    async def applied(self, step: int, scale: float, codecs: list[pb.BoundaryCodecs] = ()) -> float | None:
        """Every member applies `step` (gradients times `scale`), with `codecs` from the next step
        on; the learning rate it used. A peer that applied it already answers as it did then."""
        membership = self.membership
        answered = await self.every(
            membership.peers(),
            lambda s, peer: self.call(s, peer, STUBS.apply, step=step, scale=scale, codecs=list(codecs)),
        )
        lr = None
        for (stage, peer), frame in answered.items():
            if not frame.head.following:
                membership.served(peer)
                lr = frame.head.lr if lr is None else lr
            if frame.head.leaving:
                membership.drop(stage, peer, "it drained and leaves after this step", left=True)
        return lr

    # ---- a step applied late (train.schedule async), closing by a round -------------------------------

    async def held(self, step: int, count: int) -> tuple[float, float]:
        """Every stage's squared norm of the sum of its held gradients of `step`'s `count`
        micro-batches (a micro-batch run twice is held once; no p.grad is touched: the step before
        may not be applied yet), summed in stage order as the set_grads round sums them; and the
        learning rate the step ran at (stage 0's)."""
        indices = list(range(count))
        try:
            answered = await self.every(
                self.membership.peers(),
                lambda s, peer: self.call(s, peer, STUBS.gather, step=step, micro_batches=indices, held=True),
            )
        except RemoteError as e:  # a stage lost a micro-batch's gradients (its peer that ran it left)
            if e.code != pb.STALE:
                raise
            # the next step's micro-batches are out, so it cannot run again: the swarm's copies (trainer.recovery)
            raise TransportError(f"step {step}: {one_line(e)}, {OUTRUN}") from None
        by_stage = {stage: frame.head for (stage, _), frame in answered.items()}  # one peer per stage
        squares = 0.0
        for stage in range(self.place.num_stages):
            squares += by_stage[stage].held_sq_norm
        return squares, by_stage[0].lr

    # ---- checkpoints: the stage files, fetched from and installed on the peers ---------------------

    async def save(self, directory: Path, step: int) -> None:
        """`stage<i>.pt` per stage, fetched from a peer of the stage in service (replicas hold the
        same weights; one that fails is left out and the next one asked)."""

        async def one(stage: int):
            while True:
                peer = self.membership.serving(stage)[0]
                answered = await self.every([(stage, peer)], lambda s, peer: self.call(s, peer, STUBS.save, step=step))
                if answered:
                    frame = answered[(stage, peer)]
                    break
            atomic_write(stage_file(directory, stage), lambda f: f.write(frame.payload))

        await asyncio.gather(*(one(s) for s in range(self.place.num_stages)))
        if self.adaptive is not None:  # the links' saved state belongs to these codecs
            atomic_write(directory / CODECS_FILE, lambda f: f.write(self.adaptive.saved().encode()))

    async def load(self, directory: Path) -> tuple[int, dict | None]:
        """Installs every `stage<i>.pt` on every peer of that stage; the step, and what an adaptive
        run saved of its codecs."""
        blobs = {}
        for stage in range(self.place.num_stages):
            path = stage_file(directory, stage)
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {directory} has no {path.name}")
            blobs[stage] = path.read_bytes()
        saved = checkpoint_codecs(directory, adaptive=self.adaptive is not None)
        codecs = [] if saved is None else codec_changes(saved["codecs"])
        replies = await asyncio.gather(
            *(self.call(s, peer, STUBS.load, blobs[s], codecs=codecs) for s, peer in self.membership.peers())
        )
        steps = {int(frame.head.step) for frame in replies}
        if len(steps) != 1:
            raise ValueError(f"checkpoint {directory} mixes stages saved at steps {sorted(steps)}")
        return steps.pop(), saved


def codec_changes(codecs: dict[int, tuple[str, str]]) -> list[pb.BoundaryCodecs]:
    return [pb.BoundaryCodecs(boundary=b, forward=fw, backward=bw) for b, (fw, bw) in sorted(codecs.items())]
