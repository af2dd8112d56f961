"""A hosted stage's computing: one thread of its own, on which every computation runs one after
another in the order asked, and the computations whose time counts as the stage's training compute
(a micro-batch's forward and backward, the step's rounds)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from protocols import stage_pb2 as pb
from protocols import wire
from protocols.errors import RemoteError
from swarm.engine.linkend import LinkEnd, LinkEnds
from swarm.engine.microbatch import Kind, Message, MicroBatch, Mode
from swarm.tracing import TRACER
from swarm.transport.hivemind.net.cpu import charged
from swarm.transport.hivemind.stage.state import StageMeters, StagePlace, StageState


class StageWork:
    def __init__(self, place: StagePlace, state: StageState, meters: StageMeters) -> None:
        self.place, self.state, self.clock = place, state, meters.clock
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage{place.stage}")
        self._closed = False

    async def run(self, fn, *args):
        """`fn(*args)` on the stage's computing thread, one call after another in the order asked.
        The call is submitted before this coroutine first suspends: a caller that takes a link
        number and then awaits this keeps numbers and encodings in the same order. Its CPU time
        counts toward the request being served, if any (net.cpu: a refused one's sender pays it)."""
        if self._closed:  # a call that came in while the peer shuts down: another peer may take it
            raise RemoteError(f"stage {self.place.stage} peer is shutting down", pb.UNAVAILABLE)
        return await asyncio.get_running_loop().run_in_executor(self._executor, charged(fn), *args)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def timed(self, fn, *args):
        """`fn(*args)` (on the computing thread), its time counted as the stage's compute."""
        started = self.clock.start()
        try:
            with TRACER.span(fn.__name__.strip("_"), "compute"):
                return fn(*args)
        finally:
            self.clock.stop(started)

    # ---- a micro-batch's computations (on the computing thread) -------------------------------

    def forward(self, batch: MicroBatch, data, ends: LinkEnds) -> Message:
        started = self.clock.start()
        with TRACER.span("forward", "compute", mb=batch.label):
            message = self.state.runtime.forward(batch, data, ends)
        message.delivered()  # link state commits on encoding; a failed delivery resets the link
        if batch.mode is Mode.TRAIN:
            self.clock.stop(started, batch.size)
        return message

    def backward(self, batch: MicroBatch, payload: bytes, metrics: dict, ends: LinkEnds) -> Message:
        started = self.clock.start()
        with TRACER.span("backward", "compute", mb=batch.label):
            gradient = self.decode(payload, batch)  # at the transport's edge
            message = self.state.runtime.backward(batch, gradient, metrics, ends)
        message.delivered()
        self.clock.stop(started)
        return message

    def decode(self, payload, batch: MicroBatch):
        """A payload's message, checked against this peer's limits (protocols.wire)."""
        with TRACER.span("parse", "compute", mb=batch.label):
            return wire.decode(payload, self.place.settings.limits.decode_limits)

    def resend(self, batch: MicroBatch, outbound: LinkEnd, message: Message) -> Message:
        """The same activations for a new link: re-encoded against its fresh state."""
        if batch.mode is Mode.EVAL:
            return message  # stateless encoding: valid on any link
        out = outbound.send(batch, self.state.runtime.activations(batch))
        out.commit()
        return Message(Kind.FORWARD, self.place.stage + 1, batch, out.payload)
