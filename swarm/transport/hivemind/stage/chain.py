"""One micro-batch through a stage peer, owned by one object from its arrival to its reply (the
server only frames and dispatches it): the arrival metered, its admission (stage.admission),
forward here, the downstream call (whose reply is the gradient), backward here, and the result
back to the caller, paced. Forward and backward of a micro-batch thus use the same pair of peers on
every boundary, and their link state stays on that pair.

Several micro-batches are in flight at once: while one waits for its downstream reply, the next
one's forward runs. Order is kept where mirrored compression state needs it
(`swarm.transport.hivemind.flow.ordering`): each sender's messages are admitted in their link order
(a `Turnstile` per sender), our messages downstream are numbered in the order they are encoded
(a number is taken and the encoding submitted to the compute thread with no await in between),
and backwards run in the order the forwards ran (`Ordinals`), which keeps the gradients' link order
too. A micro-batch sent again (its first attempt's upstream peer died) may reach this stage while
the first attempt is still here: the runtime keeps one forward state per micro-batch, so the new
attempt supersedes the old one, which then ends without touching the runtime (`attempts`). Link state commits as soon as a message is encoded or decoded; any failure on a link makes the
sender start a new epoch, so both ends restart that link's state together instead of diverging.
"""

from __future__ import annotations

import asyncio
import functools
import time

from protocols import stage_pb2 as pb
from protocols.errors import PayloadError, ProtocolError, RemoteError, SenderFault, TransportError, one_line
from protocols.framing import frame_parts
from protocols.wire_names import DIGEST
from swarm.engine.exactsum import exponent_report
from swarm.engine.linkend import LinkEnds
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.tracing import TRACER
from swarm.transport.hivemind.flow.ordering import LinkReset, Ordinals, Turnstile
from swarm.transport.hivemind.flow.pacing import FlowPacer, carrying, send_paced
from swarm.transport.hivemind.net.calls import Sending
from swarm.transport.hivemind.net.streams import Request
from swarm.transport.hivemind.routing.handoff import Terms
from swarm.transport.hivemind.routing.router import RoutingPolicy
from swarm.transport.hivemind.stage.admission import Admission
from swarm.transport.hivemind.stage.closing import Closing
from swarm.transport.hivemind.stage.hop_evidence import HopEvidence
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.trip import (
    Outcome,
    Trip,
    budget,
    check_dtype,
    stage_inputs,
    trace_exchange,
    unpack,
)

_KINDS = {Kind.FORWARD: pb.FORWARD, Kind.BACKWARD: pb.BACKWARD, Kind.DONE: pb.DONE}


class Chain:
    """The micro-batches of one hosted stage: `handoff` (None on the last stage) hands them on
    downstream; `pacer` and `sending` pace and order the replies as they do what the peer sends
    downstream."""

    def __init__(self, parts: StageParts, closing: Closing, pacer: FlowPacer, sending: Sending) -> None:
        self.place, self.state, self.meters, self.work = parts.place, parts.state, parts.meters, parts.work
        self.links, self.handoff, self.pacer, self.sending = parts.links, parts.handoff, pacer, sending
        self.admission = Admission(parts)  # whether the stage takes a micro-batch now
        self.hop_evidence = HopEvidence(parts.state)  # train.verify: signed accounts of each attempt
        self.egress = parts.place.node.egress  # the node's in-process shaping, or None
        place = self.place
        self.closing = closing  # steps closed on the way: norms reported, decisions applied
        self.link_grace = place.settings.streams.link_grace_s  # a new link epoch waits this long for its first message
        self.policy = RoutingPolicy.of(place.settings)  # the throughput this peer announces
        self.ordinals = Ordinals()
        self.attempts: dict[tuple, Trip] = {}  # micro-batch key -> the attempt that owns its runtime state

    def restart(self) -> None:
        """A new session: no micro-batch of the last one counts."""
        self.ordinals = Ordinals()
        self.attempts = {}

    async def serve(self, request: Request):
        """A micro-batch from its arrival to its reply: the reply as a coroutine function that
        writes it (in paced pieces, holding a send slot to the caller)."""
        frame, sender = request.frame, request.sender
        head, size = frame.head, len(frame.payload)
        self.links.arrivals[sender].add(request.started, request.arrived, size)
        outcome = await self.run(head, frame.payload, sender)
        pacer = self.pacer
        pacer.heard(sender, head.reply_share_bits)
        pacer.arrived(sender, size)

        async def write(writer: asyncio.StreamWriter) -> None:
            waited = time.time()
            async with self.sending.to(sender):
                began = time.time()
                result = pb.ResultHead(
                    kind=_KINDS[outcome.kind],
                    metrics=outcome.metrics,
                    route=outcome.route,
                    exponents=outcome.exponents,
                    share_bits=pacer.offer(sender, self._awaiting()),
                    evidence=outcome.evidence,
                )
                flow = pacer.flow(sender)
                with carrying(flow, len(outcome.payload)):
                    for parts in frame_parts(pb.StageReply, "micro_batch", result, outcome.payload):
                        await send_paced(parts, writer, flow, self.egress)
            if TRACER.enabled:
                times = (request.started, request.arrived, waited, began)
                trace_exchange(self.place, head, sender, times, size, len(outcome.payload))

        return write

    def _awaiting(self) -> bool:
        """Whether we wait for gradients from downstream (pacing offers)."""
        return self.handoff is not None and self.handoff.awaiting > 0

    async def run(self, head: pb.MicroBatchHead, payload: bytes, sender: str) -> Outcome:
        """Admitted, forward here, then downstream and backward here; the reply for `sender`."""
        runtime = self.state.runtime
        if runtime is None:
            raise RemoteError(
                f"stage {self.place.stage} of run {self.place.run_id!r} is not set up yet (the trainer sets stages up when it starts)",
                pb.NOT_READY,
            )
        batch, carried, body = unpack(head, payload, runtime.targets)
        if self.closing.depth == 1:  # else in link order (`_chain`)
            await self._admit(head, batch, sender)
        # from arrival: the sender's clock runs meanwhile
        settings = self.place.settings
        deadline = (
            time.monotonic() + budget(head.budget_s, settings.calls.call_timeout_s) - settings.calls.budget_margin_s
        )
        trip = self.attempts[batch.key] = Trip(head, sender, batch, carried, body, deadline)
        self.state.attempts.started(batch, sender)
        self.meters.entered()
        done = False
        try:
            outcome = await self._chain(trip)
            done = True
            if runtime is self.state.runtime and self.attempts.get(batch.key) is trip:
                self.state.attempts.finished(batch, sender)  # its gradients are the ones held here now
                if batch.mode is Mode.TRAIN:  # the trainer merges them into the step's grid (exactsum)
                    report = await self.work.run(_held_report, runtime, batch.key)
                    outcome.exponents[:1] = [report]
                if batch.mode is Mode.TRAIN and self.state.cfg.train.verify:  # every one: none stands out
                    exact = not self.state.cfg.train.verify_tolerance  # bits, else a norm to compare within it
                    digest = await self.work.run(runtime.held_digest, batch.key, exact)
                    outcome.metrics[f"{DIGEST}{self.place.stage}"] = digest
                    if self.hop_evidence.kept(batch):
                        outcome.evidence = await self.work.run(self.hop_evidence.ours, trip, payload, outcome, digest)
        except BaseException:
            if runtime is self.state.runtime and self.attempts.get(batch.key) is trip:
                self.state.attempts.ended(batch)
                await self.work.run(runtime.drop, batch, LinkEnds(*trip.used))
            raise
        finally:
            self.meters.left(done)
            if self.attempts.get(batch.key) is trip:
                del self.attempts[batch.key]
        outcome.metrics = await self.closing.finished(batch, head.closing, outcome.metrics)
        return outcome

    async def _admit(self, head: pb.MicroBatchHead, batch: MicroBatch, sender: str) -> None:
        """The last step closes here first (the owner's word), then the micro-batch is checked. With
        an asynchronous schedule, in link order: micro-batches of the step before, numbered before
        this one, must have run their forward at the weights the decision replaces."""
        if head.HasField("decision"):
            await self.closing.decided(head.decision)
        self.admission.check(batch, head, sender)
        self.closing.entered(batch)

    async def _chain(self, trip: Trip) -> Outcome:
        place, links, handoff, settings = self.place, self.links, self.handoff, self.place.settings
        head, batch, sender, used = trip.head, trip.batch, trip.sender, trip.used
        trip.started = time.perf_counter()
        try:
            gate = links.turnstiles.setdefault(sender, Turnstile())
            waited = time.time()
            async with gate.admit(
                head.epoch,
                head.seq,
                max(trip.deadline - time.monotonic(), settings.calls.min_budget_s),
                self.link_grace,
            ) as fresh:
                TRACER.add("wait: link order", "wait", waited, time.time(), mb=batch.label)
                if self.closing.depth > 1:
                    await self._admit(head, batch, sender)
                if place.first:
                    data = stage_inputs(trip.carried, trip.body)
                else:
                    # checked before a number on our next link is taken: a malformed payload costs
                    # its sender's link only, never ours to the next stage (the other senders' too)
                    if trip.carried.HasField("inputs"):
                        raise SenderFault(f"stage 0's input sent to stage {place.stage}")
                    try:
                        data = await self.work.run(self.work.decode, trip.body, batch)
                        batch.check_input(data.shape)  # the engine's check, before our next link is touched
                        check_dtype(data.dtype, self.state.cfg.train.precision)
                    except PayloadError as e:
                        raise SenderFault(str(e)) from None
                    used[0] = links.end_in(sender, fresh)
                    links.received[(sender, "forward", batch.mode.value)] += len(trip.body)
                if handoff is not None:
                    trip.avoid = await handoff.avoided(head)
                record = None if handoff is None else await handoff.choose(self.state.session_id, trip.avoid)
                if record is not None:
                    used[1] = links.end_out(record.peer_id)
                    if batch.mode is Mode.TRAIN:
                        trip.ticket = self.ordinals.issue()
                    sent = links.numbering.take(record.peer_id)  # in encoding order: no await until submitted
                try:
                    message: Message = await self.work.run(self.work.forward, batch, data, LinkEnds(*used))
                except BaseException:
                    if record is not None:
                        self._drop_out(record.peer_id)  # the number we took was never sent
                    raise
            if record is None:  # the last stage: gradient (training) or metrics (eval)
                self._measure(batch, time.perf_counter() - trip.started)
                return Outcome(message.kind, message.payload, dict(message.metrics), [place.peer_id], exponents=[b""])
            return await self._downstream(trip, message, record, sent)
        finally:
            if trip.ticket is not None:
                await self.ordinals.finish(trip.ticket)

    async def _downstream(self, trip: Trip, message: Message, record, sent: tuple[int, int]) -> Outcome:
        """Sends our activations on (the handoff retries on a new link epoch or another peer) and
        runs our backward. What the head says of the run (the owner's step proof and roster, a step
        closed on the way) goes on with them."""
        place, links, work = self.place, self.links, self.work
        batch, used, deadline = trip.batch, trip.used, trip.deadline
        elapsed = time.perf_counter() - trip.started

        async def again(target: str) -> tuple[tuple[int, int], bytes]:
            """The same activations for a new link: re-encoded against its fresh state."""
            self._owns(trip)
            used[1] = links.end_out(target)
            number = links.numbering.take(target)  # in encoding order: no await until submitted
            try:
                resent = await work.run(work.resend, batch, used[1], message)
            except BaseException:
                self._drop_out(target)  # the number we took was never sent
                raise
            trip.body_out = resent.payload
            return number, resent.payload

        trip.body_out = message.payload
        last = self.state.cfg.train.micro_batches - 1
        more = not place.first and (batch.mode is not Mode.TRAIN or batch.index < last)
        try:
            offer = functools.partial(self.pacer.offer, other_active=more)
            terms = Terms(self.state.session_id, deadline, offer, trip.head, trip.avoid)
            frame, target, sent = await self.handoff.send(batch, record, sent, message.payload, again, terms)
        except TransportError as e:  # its peer is banned here now: our caller may simply try us again
            raise RemoteError(f"stage {place.stage + 1}: {one_line(e)}", pb.DOWNSTREAM) from None
        result, reply = frame.head, frame.payload
        route = [place.peer_id, *result.route]
        if result.kind == pb.DONE:
            self._measure(batch, elapsed)
            return Outcome(Kind.DONE, b"", dict(result.metrics), route)
        if result.kind != pb.BACKWARD or trip.ticket is None:
            raise ProtocolError(
                f"stage {place.stage + 1} replied with kind {result.kind} to a {batch.mode.value} micro-batch"
            )
        links.received[(target, "backward", batch.mode.value)] += len(reply)
        if self.hop_evidence.kept(batch):
            try:
                await work.run(self.hop_evidence.downstream, trip, target, reply, result.evidence)
            except RemoteError:
                self._drop_out(target)  # the reply on that link goes undecoded
                raise
        waited = time.time()
        async with self.ordinals.turn(trip.ticket, max(deadline - time.monotonic(), place.settings.calls.min_budget_s)):
            TRACER.add("wait: backward order", "wait", waited, time.time(), mb=batch.label)
            outbound = links.ends_out.get(target)
            if outbound is None or links.numbering.epoch(target) != sent[0]:
                raise LinkReset(
                    f"the link to stage {place.stage + 1} peer {target[-8:]} was reset while micro-batch {batch.key} was on it"
                )
            used[1] = outbound
            try:
                self._owns(trip)  # checked with no await before the backward is submitted
            except RemoteError:
                self._drop_out(target)  # the reply on that link goes undecoded
                raise
            started = time.perf_counter()
            try:
                back: Message = await work.run(work.backward, batch, reply, dict(result.metrics), LinkEnds(*used))
            except BaseException:
                self._drop_out(target)
                raise
        self._measure(batch, elapsed + time.perf_counter() - started)
        return Outcome(back.kind, back.payload, dict(back.metrics), route, exponents=[b"", *result.exponents])

    def _drop_out(self, receiver: str) -> None:
        """Our link to `receiver` lost its order or state: its next message starts a new epoch, and
        the next micro-batch's peer is chosen afresh."""
        self.links.drop_out(receiver)
        self.handoff.forget(receiver)

    def _measure(self, batch: MicroBatch, seconds: float) -> None:
        self.meters.measure(batch, seconds, self.policy)

    def _owns(self, trip: Trip) -> None:
        """Raises if a newer attempt of its micro-batch took over its runtime state here."""
        if self.attempts.get(trip.batch.key) is not trip:
            raise RemoteError(
                f"micro-batch {trip.batch.key} reached stage {self.place.stage} again through another peer: this attempt is void",
                pb.UNAVAILABLE,
            )


def _held_report(runtime, key: tuple) -> bytes:
    """On the computing thread: the exponents of the gradients held for micro-batch `key`."""
    return exponent_report(runtime.held.get(key, []), runtime.module)
