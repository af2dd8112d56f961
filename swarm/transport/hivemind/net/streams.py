"""Our framed exchanges on hivemind's raw P2P streams: the caller's end (`PeerStream`, kept for
reuse in a `StreamPool`) and the server's (`Requests`).

Messages are written and read as `P2P.send_protobuf` / `P2P.receive_protobuf` do (a marker byte,
a length, the bytes), but by hand: requests are written in paced pieces from views of the payload
(`swarm.transport.hivemind.flow.pacing.send_paced`), replies are read leaving the chunks' data
uncopied (`protocols.framing.parse_message`), and reading and writing are independent, so a reply
is read while the request side stays open (hivemind's `iterate_protobuf_handler` only finishes
reading once its request iterator is exhausted).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

from protocols import stage_pb2 as pb
from protocols.errors import MalformedMessage, ProtocolError, RemoteError, short
from protocols.framing import CHUNK_BYTES, Frame, Received, parse_message
from protocols.version import STREAM
from swarm.netlab.delayline import DelayLine
from swarm.transport.hivemind.flow.pacing import send_paced

PROTOCOL = STREAM  # the stream protocol of every stage call (protocols/stage.proto)
MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 20)  # one payload chunk and the head riding with the first


def peer_id_of(peer_id) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(str(peer_id))


async def read_message(
    reader: asyncio.StreamReader, begun: bool = False, limit: int = MAX_MESSAGE_BYTES
) -> bytes | None:
    """The next message's bytes, None at the end of the stream (its end marker, or closed);
    `begun`: its marker was read already. An error marker raises the peer's error; a length over
    `limit` is refused before anything of it is read (a stage message is one chunk and a head)."""
    try:
        marker = P2P.MESSAGE_MARKER if begun else await reader.readexactly(1)
        if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
            return None  # the end-of-stream marker, or garbage: either way nothing more to read
        length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        if length > limit:
            raise MalformedMessage(f"a message of {length} bytes: messages are at most {limit} bytes")
        data = await reader.readexactly(length)
    except asyncio.IncompleteReadError:  # the peer closed the stream
        return None
    if marker == P2P.ERROR_MARKER:
        error = RPCError.FromString(data)
        if error.message:
            raise RemoteError(short(RuntimeError(error.message)))
        return None
    return data


async def read_one(reader: asyncio.StreamReader, message_type, limit: int):
    """One whole `message_type` message of at most `limit` bytes (ProtocolError if the stream ends
    first or it does not parse)."""
    data = await read_message(reader, limit=limit)
    if data is None:
        raise ProtocolError("the stream ended before its message")
    try:
        return message_type.FromString(data)
    except Exception as e:
        raise ProtocolError(f"a malformed {message_type.__name__}: {e}") from None


class PeerStream:
    """The caller's end of one stream to a peer."""

    def __init__(self, reader, writer, egress=None) -> None:
        self.reader, self.writer, self.egress = reader, writer, egress  # egress: the node's in-process shaping

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, egress=None) -> PeerStream:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id_of(peer_id), PROTOCOL)
        return cls(reader, writer, egress)

    async def send(self, messages, flow=None) -> None:
        """One request's messages, serialized in parts (framing.frame_parts), paced by `flow`
        (swarm.transport.hivemind.flow.pacing) when given."""
        for parts in messages:
            await send_paced(parts, self.writer, flow, self.egress)

    async def end(self) -> None:
        line = DelayLine.existing(self.writer)
        if line is not None:  # after what is still on its way (swarm.netlab.delayline)
            line.put(P2P.ERROR_MARKER + bytes(P2P.HEADER_LEN))  # P2P.END_OF_STREAM: an empty error
            return
        await P2P.send_protobuf(P2P.END_OF_STREAM, self.writer)

    async def replies(self) -> AsyncIterator[Received]:
        """The replies as `framing.Received`, until the peer ends or closes the stream."""
        while (data := await read_message(self.reader)) is not None:
            yield parse_message(pb.StageReply, data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    @property
    def closed(self) -> bool:
        """The peer closed it (it went away, or found the stream idle too long)."""
        return self.reader.at_eof() or self.writer.is_closing()


class StreamPool:
    """Idle streams per peer, reused for later calls.

    A stream goes back to the pool only after a complete reply (nothing of that exchange is left
    on it); a failed or timed-out call closes its stream instead. The most recently used stream is
    taken first, so a link keeps about as many streams as it has calls in flight, and streams idle
    for `keep_s` are closed rather than reused (the server closes streams idle for longer, and a
    reused stream the server had just closed would fail a call)."""

    def __init__(self, p2p: P2P, keep_s: float, egress=None, end_wait_s: float = 0.0, clock=time.monotonic) -> None:
        self.p2p, self.keep_s, self.egress, self.clock = p2p, keep_s, egress, clock
        self.end_wait_s = end_wait_s  # a failed exchange waits this long for the server to close (Exchange.close)
        self._idle: dict[str, list[tuple[PeerStream, float]]] = {}
        self.opened: Counter = Counter()  # streams opened per peer

    async def take(self, peer_id: str) -> PeerStream:
        now = self.clock()
        idle = self._idle.get(peer_id, [])
        while idle:
            stream, since = idle.pop()
            if now - since < self.keep_s and not stream.closed:
                return stream
            stream.close()
        self.opened[peer_id] += 1
        return await PeerStream.open(self.p2p, peer_id, self.egress)

    def give_back(self, peer_id: str, stream: PeerStream) -> None:
        now = self.clock()
        self._close_expired(now)
        self._idle.setdefault(peer_id, []).append((stream, now))

    def _close_expired(self, now: float) -> None:
        """Closes every peer's streams idle for `keep_s`, also of peers no longer called (a stream
        holds a socket to the p2p daemon until it is closed)."""
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


class Requests:
    """The server's end of one stream: the requests a caller sends on it, one after another.

    `next` waits for the first byte of the next request and notes when it came: a sender starts
    writing a payload as soon as its send slot is free, so that byte marks the start of the
    payload's transfer (what the link meters time), whether the stream is new or reused. Every
    message besides its chunk's data is at most `max_head` bytes (framing.parse_message)."""

    def __init__(self, reader: asyncio.StreamReader, max_head: int | None = None) -> None:
        self.reader, self.max_head = reader, max_head
        self.started = 0.0
        self._marker: bytes | None = None  # the first byte of the next request, read by `next`

    async def next(self, idle_timeout: float) -> bool:
        """True when a request begins (or bytes that are none: `messages` refuses them); False
        when the caller ended the stream or let it idle."""
        try:
            marker = await asyncio.wait_for(self.reader.readexactly(1), idle_timeout)
        except (asyncio.IncompleteReadError, TimeoutError):
            return False
        self.started = time.monotonic()
        self._marker = marker
        return marker != P2P.ERROR_MARKER  # the caller's end of stream is an empty error

    async def messages(self) -> AsyncIterator[Received]:
        """This request's messages (a reader of one frame stops at its last one) and, read on,
        whatever follows until the caller ends the stream."""
        while True:
            marker, self._marker = self._marker, None
            if marker is not None and marker != P2P.MESSAGE_MARKER:
                raise MalformedMessage(f"a message marker {marker!r}: expected a message or the end of the stream")
            data = await read_message(self.reader, marker is not None)
            if data is None:
                return
            yield parse_message(pb.StageRequest, data, self.max_head)

    async def drain(self, timeout: float, limit: int) -> None:
        """Reads and drops what is left of a refused request until the caller ends the stream (its
        end marker) or closes it, so the error reply is not cut short by closing under it: at most
        `limit` bytes in as many messages as a request of that size has, within `timeout`. Messages
        are skipped unparsed, and one of no bytes ends the drain (no request has one): a flood of
        zeros reads as a stream of empty messages, and parsing those without yielding to the event
        loop once froze a stage peer for 30 s (64 zero-filled 2 MiB payloads)."""
        most = limit // CHUNK_BYTES + 4
        begun = self._marker == P2P.MESSAGE_MARKER
        self._marker = None
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                dropped = 0
                for _ in range(most):
                    marker = P2P.MESSAGE_MARKER if begun else await self.reader.readexactly(1)
                    begun = False
                    if marker != P2P.MESSAGE_MARKER:
                        return  # the caller's end marker (or garbage)
                    length = int.from_bytes(await self.reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
                    if not length or dropped + length > limit:
                        return
                    dropped += length
                    while length:
                        chunk = await self.reader.read(min(length, 1 << 16))
                        if not chunk:
                            return
                        length -= len(chunk)
                    await asyncio.sleep(0)


@dataclass(slots=True)  # one per request: slots, not frozen, construct fastest
class Request:
    """One request of a stream, framed, as its handler takes it."""

    frame: Frame
    sender: str  # the connected peer (through a relay too: the caller it names)
    started: float  # when its first byte arrived (monotonic)
    arrived: float  # when all of it had


LINGER_BYTES = 4 << 20  # what a turned-away caller may still send before the stream closes anyway
LINGER_S = 2.0


async def linger(reader: asyncio.StreamReader) -> None:
    """After a reply to a request left unread: drop what the caller still sends until it closes
    its end (at most LINGER_BYTES or LINGER_S), so that closing ours does not reset the stream
    before the caller has read the reply."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(LINGER_S):
            dropped = 0
            while dropped < LINGER_BYTES and (chunk := await reader.read(1 << 16)):
                dropped += len(chunk)
