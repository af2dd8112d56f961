"""The client side of every stage RPC, each under a deadline (`asyncio.wait_for`).

hivemind's stub methods reject a timeout for streaming calls, so the calls here go through
`P2P.iterate_protobuf_handler` / `call_protobuf_handler` directly and bound them themselves.
A micro-batch exchange is a request payload out and a reply payload (gradients, or DONE) back on
a bidirectional stream. Streams to a neighbour are kept and reused (`StreamPool`): an exchange on
a new stream cost 2.8-3.3 ms of CPU across both peers' processes and daemons, against 0.6-0.7 ms
on a kept one (`python -m swarm bench streams`: two loopback peers, 60 KiB requests). At 45
micro-batches/s through 4 links, that difference is ~0.45 s of CPU per second of a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from hivemind.p2p import P2P, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

from protocols import stage_pb2 as pb
from protocols.framing import frame_parts, parse_message, read_frame
from swarm.transport.hivemind import PROTOCOL_VERSION
from swarm.transport.hivemind.pacing import carrying, send_paced

NAMESPACE = "hivepipe"
SENDING = 1  # payloads in transfer at once per neighbour (see Sending)
SERVICER = "StageServicer"
KEEP_IDLE_S = 20.0  # a caller reuses a stream idle for less than this; the servicer waits 60 s (servicer.IDLE_S)


def handle_name(method: str) -> str:
    """The protocol name hivemind's ServicerBase registers `StageServicer.<method>` under."""
    return f"{NAMESPACE}::{SERVICER}.{method}"


class RemoteError(RuntimeError):
    """The peer answered, with an error reply (it keeps serving); `code` says what may help."""

    def __init__(self, message: str, code: int = pb.ERROR_UNSPECIFIED) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retry_link(self) -> bool:
        return self.code == pb.LINK_RESET


class TransportError(RuntimeError):
    """The peer did not answer properly: unreachable, died, timed out or sent a broken reply."""


def _peer(peer_id) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(str(peer_id))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


class _Stream:
    """A protobuf stream to a hivemind stream handler, read and written by hand.

    hivemind's `iterate_protobuf_handler` only finishes reading once its request iterator is
    exhausted, so a reply read while the request side stays open could hang on a peer that closed
    early; here reading and writing are independent.
    """

    def __init__(self, reader, writer, egress=None) -> None:
        self.reader, self.writer, self.egress = reader, writer, egress

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, method: str, egress=None) -> _Stream:
        _, reader, writer = await p2p.call_binary_stream_handler(_peer(peer_id), handle_name(method))
        return cls(reader, writer, egress)

    async def send(self, messages, flow=None) -> None:
        """One request's messages, serialized in parts (chunks.frame_parts), paced by `flow`
        (swarm.transport.hivemind.pacing) when given."""
        for i, parts in enumerate(messages):
            await send_paced(parts, self.writer, flow, self.egress, first=i == 0)

    async def end(self) -> None:
        await P2P.send_protobuf(P2P.END_OF_STREAM, self.writer)

    async def replies(self):
        """The replies as `chunks.Received` (read as `P2P.receive_protobuf` does, the chunks' data
        left uncopied), until the peer ends or closes the stream."""
        while True:
            try:
                marker = await self.reader.readexactly(1)
                if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
                    raise TypeError("Invalid Protobuf message type")
                data = await P2P.receive_raw_data(self.reader)
            except asyncio.IncompleteReadError:  # the peer closed the stream
                return
            if marker == P2P.ERROR_MARKER:
                error = RPCError.FromString(data)
                if error.message:
                    raise RemoteError(_short(RuntimeError(error.message)))
                return
            yield parse_message(pb.StageReply, data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    @property
    def closed(self) -> bool:
        """The peer closed it (it went away, or found the stream idle too long)."""
        return self.reader.at_eof() or self.writer.is_closing()


class StreamPool:
    """Idle `rpc_forward` streams per neighbour, reused for later micro-batches.

    A stream goes back to the pool only after a complete reply (nothing of that exchange is left
    on it); a failed or timed-out call closes its stream instead. The most recently used stream is
    taken first, so a link keeps about as many streams as it has micro-batches in flight, and
    streams idle for `keep_s` are closed rather than reused (the servicer closes streams idle for
    longer, and a reused stream the servicer had just closed would fail a micro-batch)."""

    def __init__(self, p2p: P2P, egress=None, keep_s: float = KEEP_IDLE_S, clock=time.monotonic) -> None:
        self.p2p, self.egress, self.keep_s, self.clock = (
            p2p,
            egress,
            keep_s,
            clock,
        )  # egress: the node's in-process shaping
        self._idle: dict[str, list[tuple[_Stream, float]]] = {}
        self.opened = 0

    async def take(self, peer_id: str) -> _Stream:
        now = self.clock()
        idle = self._idle.get(peer_id, [])
        while idle:
            stream, since = idle.pop()
            if now - since < self.keep_s and not stream.closed:
                return stream
            stream.close()
        self.opened += 1
        return await _Stream.open(self.p2p, peer_id, "rpc_forward", self.egress)

    def give_back(self, peer_id: str, stream: _Stream) -> None:
        now = self.clock()
        self._close_expired(now)
        self._idle.setdefault(peer_id, []).append((stream, now))

    def _close_expired(self, now: float) -> None:
        """Closes every neighbour's streams idle for `keep_s`, also of neighbours no longer called
        (a stream holds a socket to the p2p daemon until it is closed)."""
        for peer_id, idle in list(self._idle.items()):
            while idle and now - idle[0][1] >= self.keep_s:  # the oldest first: they have not been wanted
                idle.pop(0)[0].close()
            if not idle:
                del self._idle[peer_id]

    def idle(self, peer_id: str) -> int:
        return len(self._idle.get(peer_id, ()))

    def close(self) -> None:
        for idle in self._idle.values():
            for stream, _ in idle:
                stream.close()
        self._idle.clear()


class Sending:
    """A peer's outgoing payloads: at most `SENDING` at once per neighbour, in the order they asked.

    Concurrent streams share a link fairly, so micro-batches sent together would all arrive at
    the end of the step; sent one at a time, the first arrives after about its own transfer
    time and the next stage starts on it while the rest follow: that is what pipelining needs.
    Unpaced, one at a time and two at a time measured the same (59-60% of the link bound, 4
    stages at 100 Mbit/s); with per-flow pacing (swarm.transport.hivemind.pacing) one at a time gave 84%
    against 77% for two: a paced payload leaves at its flow's rate, and a second one in transfer
    only delays the first."""

    def __init__(self, per_neighbour: int = SENDING) -> None:
        self.per_neighbour = per_neighbour
        self._slots: dict[str, asyncio.Semaphore] = {}

    def to(self, peer_id: str) -> asyncio.Semaphore:
        slot = self._slots.get(peer_id)
        if slot is None:
            slot = self._slots[peer_id] = asyncio.Semaphore(self.per_neighbour)
        return slot


class MicroBatchCall:
    """One micro-batch exchange with a downstream stage peer (or stage 0, from the trainer), on a
    stream from `streams`; `finish` returns that stream once the reply has been read."""

    def __init__(
        self,
        streams: StreamPool,
        peer_id: str,
        head: pb.MicroBatchHead,
        payload: bytes,
        sending: Sending | None = None,
        flow=None,
    ) -> None:
        self.streams, self.peer_id = streams, str(peer_id)
        self.sending, self.flow = sending, flow
        self.head, self.payload = head, payload
        self._stream: _Stream | None = None
        self._replies = None
        self._complete = False  # the whole reply was read: the stream may carry another exchange

    async def _exchange(self) -> tuple[pb.ResultHead, bytes]:
        async with self.sending.to(self.peer_id) if self.sending else contextlib.nullcontext():
            # taken only now: the receiver times the payload from its first byte
            self._stream = await self.streams.take(self.peer_id)
            with carrying(self.flow, len(self.payload)):
                await self._stream.send(frame_parts(pb.StageRequest, "micro_batch", self.head, self.payload), self.flow)
        self._replies = self._stream.replies()
        head, payload = await read_frame(self._reply_messages(), "result")
        if isinstance(head, pb.ErrorReply):
            raise RemoteError(head.message, head.code)
        self._complete = True
        return head, payload

    def _reply_messages(self):
        """The reply stream as `_exchange` reads it (a subclass may watch it go by)."""
        return self._replies

    async def reply(self, timeout: float) -> tuple[pb.ResultHead, bytes]:
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
            raise TransportError(f"peer {self.peer_id[-8:]}: {_short(e)}") from e

    def finish(self) -> None:
        """After `reply` returned: the stream goes back to the pool for the next micro-batch."""
        stream, self._stream = self._stream, None
        if stream is not None and self._complete:
            self.streams.give_back(self.peer_id, stream)
        elif stream is not None:
            stream.close()

    async def close(self, timeout: float = 2.0) -> None:
        """Ends a failed call: the replier may close its side once it sees the end of our stream."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:

            async def finish():
                await stream.end()
                if self._replies is not None:
                    async for _ in self._replies:  # until the replier closes the stream
                        pass

            with contextlib.suppress(Exception):
                await asyncio.wait_for(finish(), timeout)
        finally:
            stream.close()


async def call_step(
    p2p: P2P, peer_id: str, head: pb.StepHead, payload: bytes, timeout: float, egress=None
) -> tuple[pb.StepResult, bytes]:
    async def run():
        stream = await _Stream.open(p2p, peer_id, "rpc_step", egress)
        try:
            await stream.send(frame_parts(pb.StageRequest, "step", head, payload))
            result, data = await read_frame(stream.replies(), "step")
            await stream.end()  # only now may the servicer close its end (see `servicer._linger`)
        finally:
            stream.close()
        if isinstance(result, pb.ErrorReply):
            raise RemoteError(result.message, result.code)
        return result, data

    return await _bounded(run(), peer_id, timeout)


async def call_setup(p2p: P2P, peer_id: str, request: pb.SetupRequest, timeout: float) -> pb.SetupReply:
    reply = await _bounded(
        p2p.call_protobuf_handler(_peer(peer_id), handle_name("rpc_setup"), request, pb.SetupReply), peer_id, timeout
    )
    if reply.error:
        raise RemoteError(reply.error)
    return reply


async def call_info(p2p: P2P, peer_id: str, run_id: str = "", timeout: float = 10.0) -> pb.InfoReply:
    request = pb.InfoRequest(protocol_version=PROTOCOL_VERSION, run_id=run_id)
    reply = await _bounded(
        p2p.call_protobuf_handler(_peer(peer_id), handle_name("rpc_info"), request, pb.InfoReply), peer_id, timeout
    )
    if reply.error:
        raise RemoteError(reply.error)
    return reply


async def _bounded(coro, peer_id: str, timeout: float):
    try:
        return await asyncio.wait_for(coro, timeout)
    except RemoteError:
        raise
    except TimeoutError:
        raise TransportError(f"peer {str(peer_id)[-8:]} did not reply within {timeout:.1f}s") from None
    except Exception as e:
        raise TransportError(f"peer {str(peer_id)[-8:]}: {_short(e)}") from e
