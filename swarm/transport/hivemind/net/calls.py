"""The one client stack: a request and its reply on a stream from the node's pool, under a deadline.

Every call, a micro-batch or a control request (setup, a step round, a checkpoint, a status), is
an `Exchange`: the request's frame (`protocols.framing.frame_parts`: the typed head, the payload in
checked chunks), written paced when a flow is given, then the reply's frame, whose head must have
the request's kind (or be an error). Streams are kept and reused (`streams.StreamPool`): opening
one costs the two peers' processes and daemons several times the CPU of an exchange on a kept one
(`python -m swarm bench streams` measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from protocols import stage_pb2 as pb
from protocols.calls import CALLS
from protocols.errors import RemoteError, Replied, TransportError, short
from protocols.framing import MAX_PAYLOAD_BYTES, Frame, frame_parts, read_frame
from protocols.stubs import Request
from swarm.tracing import TRACER
from swarm.transport.hivemind.flow.busy import Busy
from swarm.transport.hivemind.flow.meter import LinkMeter, timed_chunks
from swarm.transport.hivemind.flow.pacing import carrying
from swarm.transport.hivemind.net.streams import PeerStream, StreamPool
from swarm.transport.hivemind.trust.signatures import sign_call


class Sending:
    """A peer's outgoing payloads: at most `per_neighbour` at once to one neighbour, in the order
    they asked.

    Concurrent streams share a link, so micro-batches sent together would all arrive at the end of
    the step; sent one at a time, the first arrives after about its own transfer time and the next
    stage starts on it while the rest follow: that is what pipelining needs. A paced payload leaves
    at its flow's rate, so a second one in transfer would only delay the first (docs/bench)."""

    def __init__(self, per_neighbour: int = 1) -> None:
        self.per_neighbour = per_neighbour
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.busy = Busy()  # seconds with a payload being sent to any neighbour (its metrics' "sending")

    @contextlib.asynccontextmanager
    async def to(self, peer_id: str):
        """Holds a send slot to `peer_id` (waiting for one first) while the payload is written."""
        slot = self._slots.get(peer_id)
        if slot is None:
            slot = self._slots[peer_id] = asyncio.Semaphore(self.per_neighbour)
        async with slot:
            with self.busy.during():
                yield


@dataclass(slots=True)  # one per micro-batch: slots, not frozen, construct fastest
class Carriage:
    """How an exchange carries its request and takes its reply.

    `sending`: the send slot per neighbour to take for the payload; `flow`: its pacing;
    `meter`: times the reply's arrival (the link's backward direction); `auth`: a control call's
    signature (swarm.transport.hivemind.trust.signatures); `max_reply_bytes`: the largest reply
    payload taken (refused from its first chunk when declared larger); `traced`: (what the
    timeline calls it, e.g. a micro-batch's label; the exchange's unique key) to record its spans
    and its times as the caller (swarm.tracing)."""

    sending: Sending | None = None
    flow: object = None
    meter: LinkMeter | None = None
    auth: pb.Auth | None = None
    max_reply_bytes: int = MAX_PAYLOAD_BYTES
    traced: tuple[str, str] | None = None


PLAIN = Carriage()  # unpaced, unsigned, unmetered, untraced


class Exchange:
    """One request to `peer_id` and its reply, on a stream from `streams`, carried as `how` says;
    `finish` returns that stream to the pool once the reply has been read (a failed exchange
    closes it)."""

    def __init__(
        self, streams: StreamPool, peer_id: str, kind: str, head, payload: bytes = b"", how: Carriage = PLAIN
    ) -> None:
        self.streams, self.peer_id = streams, str(peer_id)
        self.kind, self.head, self.payload = kind, head, payload
        self.auth, self.max_reply_bytes, self.traced = how.auth, how.max_reply_bytes, how.traced
        self.sending, self.flow, self.meter = how.sending, how.flow, how.meter
        self._stream: PeerStream | None = None
        self._replies = None
        self._complete = False  # the whole reply was read: the stream may carry another exchange

    async def _exchange(self) -> Frame:
        waited = time.time()
        async with self.sending.to(self.peer_id) if self.sending else contextlib.nullcontext():
            # taken only now: the receiver times the payload from its first byte
            began = time.time()
            self._stream = await self.streams.take(self.peer_id)
            with carrying(self.flow, len(self.payload)):
                extra = {"auth": self.auth} if self.auth is not None else {}
                parts = frame_parts(pb.StageRequest, self.kind, self.head, self.payload, **extra)
                await self._stream.send(parts, self.flow)
        sent = time.time()
        self._replies = self._stream.replies()
        replies = self._replies if self.meter is None else timed_chunks(self._replies, self.meter)
        arrived: list[float] = []  # when the reply began to arrive (the exchange's times, traced)
        frame = await read_frame(_first_noted(replies, arrived), self.kind, self.max_reply_bytes)
        if self.traced is not None:
            self._trace(waited, began, sent, arrived[0] if arrived else time.time(), len(frame.payload))
        if frame.kind == "error":
            raise Replied(frame.head.message, frame.head.code, frame.head.blamed, frame.head.stale)
        self._complete = True
        return frame

    def _trace(self, waited: float, began: float, sent: float, arrived: float, reply_bytes: int) -> None:
        label, key = self.traced
        to = f"stage{self.head.to.stage} {self.peer_id[-4:]}"
        TRACER.add("wait: send slot", "wait", waited, began, mb=label)
        TRACER.add("send", f"send to {to}", began, sent, mb=label, bytes=len(self.payload))
        TRACER.add("awaiting reply", f"await {to}", sent, time.time(), mb=label, bytes=reply_bytes)
        TRACER.exchange("caller", self.peer_id, key, began, arrived)

    async def reply(self, timeout: float) -> Frame:
        """Sends the request and waits (at most `timeout` s) for the verified reply."""
        try:
            return await asyncio.wait_for(self._exchange(), timeout)
        except RemoteError:
            await self.close()
            raise
        except TimeoutError:
            await self.close()
            raise TransportError(f"peer {self.peer_id[-8:]} did not reply within {timeout:.1f}s") from None
        except Exception as e:
            await self.close()
            raise TransportError(f"peer {self.peer_id[-8:]}: {short(e)}") from e

    def finish(self) -> None:
        """After `reply` returned: the stream goes back to the pool for the next exchange."""
        stream, self._stream = self._stream, None
        if stream is not None and self._complete:
            self.streams.give_back(self.peer_id, stream)
        elif stream is not None:
            stream.close()

    async def close(self, timeout: float = 2.0) -> None:
        """Ends a failed exchange: the server may close its side once it sees the end of our stream."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:

            async def finish():
                await stream.end()
                if self._replies is not None:
                    async for _ in self._replies:  # until the server closes the stream
                        pass

            with contextlib.suppress(Exception):
                await asyncio.wait_for(finish(), timeout)
        finally:
            stream.close()


async def call(streams: StreamPool, peer_id: str, kind: str, head, payload: bytes, timeout: float, owner=None) -> Frame:
    """A request other than a micro-batch (setup, a step round, a checkpoint, a copy, a state
    download, a status) and its verified reply; a call only the run's owner makes
    (protocols.calls) is signed with `owner`'s key."""
    auth = sign_call(owner, kind, head, payload, str(peer_id)) if owner is not None and CALLS[kind].signed else None
    exchange = Exchange(streams, peer_id, kind, head, payload, Carriage(auth=auth))
    frame = await exchange.reply(timeout)
    exchange.finish()
    return frame


async def ask(
    streams: StreamPool, peer_id: str, request: Request, timeout: float, payload: bytes = b"", owner=None
) -> Frame:
    """`request`, a typed stub's (protocols.stubs: the kind travels with its head, so no call site
    names a kind by its string), and its `payload` to `peer_id`: its verified reply, within `timeout` s."""
    return await call(streams, peer_id, request.kind, request.head, payload, timeout, owner)


async def _first_noted(messages, noted: list[float]):
    """`messages`, noting when the first came."""
    async for message in messages:
        if not noted:
            noted.append(time.time())
        yield message
