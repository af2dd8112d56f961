"""One micro-batch through a stage peer: forward here, the downstream call (whose reply is the
gradient), backward here, and the result back to the caller. Forward and backward of a micro-batch
thus use the same pair of peers on every boundary, and their link state stays on that pair.

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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocols import carried as envelope
from protocols import stage_pb2 as pb
from protocols.errors import PayloadError, ProtocolError, RemoteError, SenderFault, TransportError, one_line
from protocols.wire_names import DIGEST
from swarm.engine.linkend import LinkEnds
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.engine.precision import activation_dtypes
from swarm.tracing import TRACER, wall
from swarm.transport.hivemind.flow.ordering import LinkReset, Ordinals, Turnstile
from swarm.transport.hivemind.flow.pacing import FlowPacer
from swarm.transport.hivemind.net.meta import meta_to_batch, raw_to_tensor
from swarm.transport.hivemind.routing.router import RoutingPolicy
from swarm.transport.hivemind.stage.closing import Closing
from swarm.transport.hivemind.stage.parts import StageParts
from swarm.transport.hivemind.stage.state import StagePlace


@dataclass
class Outcome:
    """A processed micro-batch: the reply for the caller."""

    kind: Kind
    payload: bytes = b""
    metrics: dict[str, float] = field(default_factory=dict)
    route: list[str] = field(default_factory=list)


class Chain:
    """The micro-batches of one hosted stage: `serving(batch, head, sender)` says whether the stage
    takes one now (raises if not); `handoff` (None on the last stage) hands them on downstream."""

    def __init__(
        self, parts: StageParts, pacer: FlowPacer, serving: Callable[[MicroBatch, pb.StepProof], None], closing: Closing
    ) -> None:
        self.place, self.state, self.meters, self.work = parts.place, parts.state, parts.meters, parts.work
        self.links, self.handoff, self.pacer, self.serving = parts.links, parts.handoff, pacer, serving
        place = self.place
        self.closing = closing  # steps closed on the way: norms reported, decisions applied
        self.link_grace = place.settings.streams.link_grace_s  # a new link epoch waits this long for its first message
        self.policy = RoutingPolicy.of(place.settings)  # the throughput this peer announces
        self.ordinals = Ordinals()
        self.attempts: dict[tuple, object] = {}  # micro-batch key -> the attempt that owns its runtime state

    def restart(self) -> None:
        """A new session: no micro-batch of the last one counts."""
        self.ordinals = Ordinals()
        self.attempts = {}

    async def run(self, head: pb.MicroBatchHead, payload: bytes, sender: str) -> Outcome:
        """Forward here, then downstream and backward here; the reply for `sender`."""
        runtime = self.state.runtime
        if runtime is None:
            raise RemoteError(
                f"stage {self.place.stage} of run {self.place.run_id!r} is not set up yet (the trainer sets stages up when it starts)",
                pb.NOT_READY,
            )
        batch, carried, body = _unpack(head, payload, runtime.targets)
        if self.closing.depth == 1:  # else in link order (`_chain`)
            await self._admit(head, batch, sender)
        # from arrival: the sender's clock runs meanwhile
        settings = self.place.settings
        deadline = (
            time.monotonic() + _budget(head.budget_s, settings.calls.call_timeout_s) - settings.calls.budget_margin_s
        )
        used = [None, None]  # the link ends this micro-batch computed with (inbound, outbound)
        attempt = self.attempts[batch.key] = object()
        self.state.attempts.started(batch, sender)
        self.meters.entered()
        done = False
        try:
            outcome = await self._chain(head, batch, carried, body, sender, deadline, used, attempt)
            done = True
            if runtime is self.state.runtime and self.attempts.get(batch.key) is attempt:
                self.state.attempts.finished(batch, sender)  # its gradients are the ones held here now
                if batch.mode is Mode.TRAIN and self.state.cfg.train.verify:  # every one: none stands out
                    exact = not self.state.cfg.train.verify_tolerance  # bits, else a norm to compare within it
                    digest = await self.work.run(runtime.held_digest, batch.key, exact)
                    outcome.metrics[f"{DIGEST}{self.place.stage}"] = digest
        except BaseException:
            if runtime is self.state.runtime and self.attempts.get(batch.key) is attempt:
                self.state.attempts.ended(batch)
                await self.work.run(runtime.drop, batch, LinkEnds(*used))
            raise
        finally:
            self.meters.left(done)
            if self.attempts.get(batch.key) is attempt:
                del self.attempts[batch.key]
        outcome.metrics = await self.closing.finished(batch, head.closing, outcome.metrics)
        return outcome

    async def _admit(self, head: pb.MicroBatchHead, batch: MicroBatch, sender: str) -> None:
        """The last step closes here first (the owner's word), then the micro-batch is checked. With
        an asynchronous schedule, in link order: micro-batches of the step before, numbered before
        this one, must have run their forward at the weights the decision replaces."""
        if head.HasField("decision"):
            await self.closing.decided(head.decision)
        self.serving(batch, head, sender)
        self.closing.entered(batch)

    async def _chain(
        self,
        head: pb.MicroBatchHead,
        batch: MicroBatch,
        carried: pb.Carried,
        body: memoryview,
        sender: str,
        deadline: float,
        used: list,
        attempt: object,
    ) -> Outcome:
        place, links, handoff, settings = self.place, self.links, self.handoff, self.place.settings
        started = time.perf_counter()
        ticket = None
        try:
            gate = links.turnstiles.setdefault(sender, Turnstile())
            waited = time.time()
            async with gate.admit(
                head.epoch, head.seq, max(deadline - time.monotonic(), settings.calls.min_budget_s), self.link_grace
            ) as fresh:
                TRACER.add("wait: link order", "wait", waited, time.time(), mb=batch.label)
                if self.closing.depth > 1:
                    await self._admit(head, batch, sender)
                if place.first:
                    data = _inputs(carried, body)
                else:
                    # checked before a number on our next link is taken: a malformed payload costs
                    # its sender's link only, never ours to the next stage (the other senders' too)
                    if carried.HasField("inputs"):
                        raise SenderFault(f"stage 0's input sent to stage {place.stage}")
                    try:
                        data = await self.work.run(self.work.decode, body, batch)
                        batch.check_input(data.shape)  # the engine's check, before our next link is touched
                        _check_dtype(data.dtype, self.state.cfg.train.precision)
                    except PayloadError as e:
                        raise SenderFault(str(e)) from None
                    used[0] = links.end_in(sender, fresh)
                    links.received[(sender, "forward", batch.mode.value)] += len(body)
                record = None if handoff is None else await handoff.choose(self.state.session_id, head.avoid)
                if record is not None:
                    used[1] = links.end_out(record.peer_id)
                    if batch.mode is Mode.TRAIN:
                        ticket = self.ordinals.issue()
                    sent = links.numbering.take(record.peer_id)  # in encoding order: no await until submitted
                try:
                    message: Message = await self.work.run(self.work.forward, batch, data, LinkEnds(*used))
                except BaseException:
                    if record is not None:
                        self._drop_out(record.peer_id)  # the number we took was never sent
                    raise
            if record is None:  # the last stage: gradient (training) or metrics (eval)
                self._measure(batch, time.perf_counter() - started)
                return Outcome(message.kind, message.payload, dict(message.metrics), [place.peer_id])
            return await self._downstream(batch, message, record, sent, ticket, started, deadline, used, attempt, head)
        finally:
            if ticket is not None:
                await self.ordinals.finish(ticket)

    async def _downstream(
        self,
        batch: MicroBatch,
        message: Message,
        record,
        sent,
        ticket,
        started: float,
        deadline: float,
        used: list,
        attempt: object,
        head: pb.MicroBatchHead,
    ) -> Outcome:
        """Sends our activations on (the handoff retries on a new link epoch or another peer) and
        runs our backward. What the head says of the run (the owner's step proof and roster, a step
        closed on the way) goes on with them."""
        place, links, work = self.place, self.links, self.work
        elapsed = time.perf_counter() - started

        async def again(target: str) -> tuple[tuple[int, int], bytes]:
            """The same activations for a new link: re-encoded against its fresh state."""
            self._owns(batch, attempt)
            used[1] = links.end_out(target)
            number = links.numbering.take(target)  # in encoding order: no await until submitted
            try:
                resent = await work.run(work.resend, batch, used[1], message)
            except BaseException:
                self._drop_out(target)  # the number we took was never sent
                raise
            return number, resent.payload

        last = self.state.cfg.train.micro_batches - 1
        more = not place.first and (batch.mode is not Mode.TRAIN or batch.index < last)
        try:
            frame, target, sent = await self.handoff.send(
                batch,
                record,
                sent,
                message.payload,
                self.state.session_id,
                again,
                deadline=deadline,
                offer=lambda peer: self.pacer.offer(peer, more),
                carry=head,
            )
        except TransportError as e:  # its peer is banned here now: our caller may simply try us again
            raise RemoteError(f"stage {place.stage + 1}: {one_line(e)}", pb.DOWNSTREAM) from None
        result, reply = frame.head, frame.payload
        route = [place.peer_id, *result.route]
        if result.kind == pb.DONE:
            self._measure(batch, elapsed)
            return Outcome(Kind.DONE, b"", dict(result.metrics), route)
        if result.kind != pb.BACKWARD or ticket is None:
            raise ProtocolError(
                f"stage {place.stage + 1} replied with kind {result.kind} to a {batch.mode.value} micro-batch"
            )
        links.received[(target, "backward", batch.mode.value)] += len(reply)
        waited = time.time()
        async with self.ordinals.turn(ticket, max(deadline - time.monotonic(), place.settings.calls.min_budget_s)):
            TRACER.add("wait: backward order", "wait", waited, time.time(), mb=batch.label)
            outbound = links.ends_out.get(target)
            if outbound is None or links.numbering.epoch(target) != sent[0]:
                raise LinkReset(
                    f"the link to stage {place.stage + 1} peer {target[-8:]} was reset while micro-batch {batch.key} was on it"
                )
            used[1] = outbound
            try:
                self._owns(batch, attempt)  # checked with no await before the backward is submitted
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
        return Outcome(back.kind, back.payload, dict(back.metrics), route)

    def _drop_out(self, receiver: str) -> None:
        """Our link to `receiver` lost its order or state: its next message starts a new epoch, and
        the next micro-batch's peer is chosen afresh."""
        self.links.drop_out(receiver)
        self.handoff.forget(receiver)

    def _measure(self, batch: MicroBatch, seconds: float) -> None:
        self.meters.measure(batch, seconds, self.policy)

    def _owns(self, batch: MicroBatch, attempt: object) -> None:
        """Raises if a newer attempt of `batch` took over its runtime state here."""
        if self.attempts.get(batch.key) is not attempt:
            raise RemoteError(
                f"micro-batch {batch.key} reached stage {self.place.stage} again through another peer: this attempt is void",
                pb.UNAVAILABLE,
            )


def _check_dtype(dtype: torch.dtype, precision: str) -> None:
    """A payload declaring activations of a dtype no stage of this run gives is its sender's fault
    (an fp16 payload in an fp32 run would pass as exact values and fail stages further on)."""
    allowed = activation_dtypes(precision)
    if dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise PayloadError(f"activations in {str(dtype).removeprefix('torch.')}: this run's stages send {names}")


def _budget(declared: float, most: float) -> float:
    """The seconds a micro-batch may take here: what its sender says it waits, never more than any
    caller of ours waits (a member's 1e308 would park its payload for good), the most when unsaid
    or not a number."""
    if not (math.isfinite(declared) and declared > 0):
        return most
    return min(declared, most)


def _unpack(head: pb.MicroBatchHead, payload: bytes, targets) -> tuple[MicroBatch, pb.Carried, memoryview]:
    """The micro-batch of `head` and its payload, what it carries and a view of its activations;
    a malformed payload, or targets its loss does not take (`targets`: swarm.models.base.Targets,
    None: not known), are its sender's fault."""
    try:
        carried, body = envelope.unpack(payload)
        batch = meta_to_batch(head.batch, carried)
    except (PayloadError, ProtocolError) as e:
        raise SenderFault(str(e)) from None
    if targets is not None and (problem := targets.problem(batch.targets, batch.mode is Mode.EVAL)) is not None:
        raise SenderFault(f"targets: {problem}")
    return batch, carried, body


def _inputs(carried: pb.Carried, body: memoryview):
    """Stage 0's input: carried, with no activations after it."""
    if not carried.HasField("inputs") or len(body):
        raise SenderFault("a micro-batch for stage 0 carries its input and nothing after it")
    try:
        return raw_to_tensor(carried.inputs, "stage 0 input")
    except ProtocolError as e:
        raise SenderFault(str(e)) from None


_MODES = {pb.TRAIN: "train", pb.EVAL: "eval"}


def trace_exchange(place: StagePlace, head: pb.MicroBatchHead, sender: str, times, size: int, reply: int) -> None:
    """A micro-batch exchange as its callee saw it: the request arriving (`times`: its first byte and
    its whole, monotonic), the wait for a send slot and the reply leaving (wall seconds), and when
    the request began to arrive and the reply began to leave, which swarm.timeline pairs with the
    caller's times to align the two clocks."""
    started, arrived, waited, began = times
    label = f"{_MODES.get(head.batch.mode, '?')}/{head.batch.step}/{head.batch.index}"
    who = "trainer" if place.first else f"stage{place.stage - 1}"
    TRACER.add("receive", f"receive from {who} {sender[-4:]}", wall(started), wall(arrived), mb=label, bytes=size)
    TRACER.add("wait: send slot", "wait", waited, began, mb=label)
    done = time.time()
    TRACER.add("send reply", f"send to {who} {sender[-4:]}", began, done, mb=label, bytes=reply)
    TRACER.exchange("callee", sender, f"{label}/{head.epoch}/{head.seq}", wall(started), began)
