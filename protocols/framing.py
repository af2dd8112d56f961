"""Payloads cut into chunks that each repeat the total length and crc32, and their reassembly.

hivemind neither checks a stream's chunk count nor its length, and a streamed reply was seen to
end short without an error; so every payload is verified here before anyone decodes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NamedTuple

from google.protobuf.message import DecodeError

from protocols import fields
from protocols import stage_pb2 as pb
from protocols.checksum import crc32
from protocols.errors import MalformedMessage, ProtocolError

CHUNK_BYTES = 1 << 20  # well under hivemind's 2 MiB unary guidance and 4 MiB message cap
MAX_PAYLOAD_BYTES = 1 << 34  # stage checkpoints and gradients of big stages


class Assembler:
    """Collects the chunks of one payload and verifies them; refuses, before collecting, a payload
    over `max_bytes` or chunked other than `frame` does (full chunks, then the rest)."""

    def __init__(self, max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self.max_bytes = max_bytes
        self.parts: list[bytes] = []
        self.count = self.total = self.crc = None
        self.size = 0

    def add(self, chunk: pb.Chunk, data: bytes | memoryview | None = None) -> bool:
        """Adds a chunk (its `data` when received apart: parse_message); True once the payload is complete."""
        if self.count is None:
            if chunk.total_length > self.max_bytes:
                raise ProtocolError(
                    f"payload of {chunk.total_length} bytes exceeds this peer's limit of {self.max_bytes} bytes"
                )
            if chunk.count != max(1, -(-chunk.total_length // CHUNK_BYTES)):
                raise ProtocolError(
                    f"bad chunk header: {chunk.count} chunks for {chunk.total_length} bytes (chunks are {CHUNK_BYTES} bytes)"
                )
            self.count, self.total, self.crc = chunk.count, chunk.total_length, chunk.crc32
        elif (chunk.count, chunk.total_length, chunk.crc32) != (self.count, self.total, self.crc):
            raise ProtocolError("chunk totals changed within one payload")
        if chunk.index != len(self.parts):
            raise ProtocolError(f"chunk {chunk.index} arrived, expected chunk {len(self.parts)} of {self.count}")
        if data is None:
            data = chunk.data  # once: upb copies a bytes field on every access
        if len(data) > CHUNK_BYTES:
            raise ProtocolError(f"chunk of {len(data)} bytes, more than {CHUNK_BYTES}")
        self.size += len(data)
        if self.size > self.total:
            raise ProtocolError(f"payload longer than announced: {self.size} > {self.total} bytes")
        self.parts.append(data)
        return len(self.parts) == self.count

    def payload(self) -> bytes:
        if self.count is None or len(self.parts) != self.count:
            got = 0 if self.count is None else len(self.parts)
            raise ProtocolError(
                f"truncated payload: {got} of {self.count or '?'} chunks, {self.size} of {self.total or '?'} bytes"
            )
        data = b"".join(self.parts)
        if len(data) != self.total:
            raise ProtocolError(f"truncated payload: {len(data)} of {self.total} bytes")
        if crc32(data) != self.crc:
            raise ProtocolError("payload checksum mismatch (corrupted in transit)")
        return data


async def _each(messages: AsyncIterator, idle_timeout: float | None):
    """The messages, each within `idle_timeout` seconds of the previous one (a slow link may take
    long for a whole payload, but a silent peer is noticed). Read in the caller's task (not
    `wait_for`'s own): what parsing them costs is the caller's (swarm.transport.hivemind.net.cpu)."""
    iterator = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_timeout):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ProtocolError(f"no message for {idle_timeout:.0f}s in the middle of a payload") from None
        yield message


class Frame(NamedTuple):
    """One request or reply: the name of its head (the oneof field), the head, the verified payload."""

    kind: str
    head: object
    payload: bytes
    first: object = None  # the first message (its other fields: a request's signature)


async def read_frame(
    messages: AsyncIterator,
    head_field: str | None = None,
    max_bytes: int | Callable[[str], int] = MAX_PAYLOAD_BYTES,
    idle_timeout: float | None = None,
    check: Callable[[str, object], None] | None = None,
) -> Frame:
    """One framed message sequence (protobuf messages, or `Received` ones): the head rides on the
    first message, the payload's chunks follow.

    The head is checked against `head_field` when given (an `error` head is returned as is, with
    no payload); the payload may be at most `max_bytes`, or `max_bytes(kind)` for the head's kind.
    `check(kind, first message)` runs before any of the payload is collected (it raises to refuse).
    """
    first = None
    assembler = None
    async for item in _each(messages, idle_timeout):
        message, data = Received.of(item)
        if first is None:
            first = message
            kind = message.WhichOneof("head")
            if kind == "error":
                return Frame(kind, message.error, b"")
            if kind is None:
                raise MalformedMessage("the first message has no head")
            if head_field is not None and kind != head_field:
                raise ProtocolError(f"expected a {head_field} head, got {kind}")
            if check is not None:
                check(kind, message)
            assembler = Assembler(max_bytes(kind) if callable(max_bytes) else max_bytes)
        elif message.WhichOneof("head") is not None:
            raise MalformedMessage("a head arrived in the middle of a payload")
        if not message.HasField("chunk"):
            raise MalformedMessage("message without a payload chunk")
        if assembler.add(message.chunk, data):
            return Frame(kind, getattr(first, kind), assembler.payload(), first)
    if first is None:
        raise ProtocolError("the stream ended before any message")
    assembler.payload()  # raises: truncated
    raise ProtocolError("truncated payload")


def _last_field(message_type, name: str) -> int:
    """The number of field `name`, which must be the message's last: hand-written fields follow
    the ones protobuf writes, and protobuf writes fields in number order."""
    number = message_type.DESCRIPTOR.fields_by_name[name].number
    if number != max(f.number for f in message_type.DESCRIPTOR.fields):
        raise ImportError(f"{message_type.__name__}.{name} is not its last field: frame_parts cannot write it by hand")
    return number


_DATA = _last_field(pb.Chunk, "data")
_CHUNK = {message_type: _last_field(message_type, "chunk") for message_type in (pb.StageRequest, pb.StageReply)}


def frame_parts(
    message_type, head_field: str, head, payload: bytes, chunk_bytes: int = CHUNK_BYTES, **extra
) -> Iterator[tuple]:
    """The messages carrying `head` and `payload` (head on the first one, with the fields `extra`,
    e.g. a request's signature; at least one message, even for an empty payload), each serialized as
    the bytes before its chunk's data and that data, a view of `payload`: written to a stream as
    they are, the payload is never copied here."""
    total, crc = len(payload), crc32(payload)
    count = max(1, -(-total // chunk_bytes))
    view = memoryview(payload)
    head_bytes = message_type(**{head_field: head}, **extra).SerializeToString()
    for i in range(count):
        data = view[i * chunk_bytes : (i + 1) * chunk_bytes]
        header = pb.Chunk(index=i, count=count, total_length=total, crc32=crc).SerializeToString()
        segments = [
            head_bytes if i == 0 else b"",
            *fields.length_delimited(_CHUNK[message_type], [header, *fields.bytes_field(_DATA, data)]),
        ]
        yield (b"".join(segments[:-1]), data) if len(data) else (b"".join(segments),)


class Received(NamedTuple):
    """A message read off a stream, and its chunk's data when that was left out of it (a view of
    the bytes received; None: the data, if any, is in the message)."""

    message: object
    data: memoryview | None

    @classmethod
    def of(cls, item) -> Received:
        """`item` as a Received: a protobuf message (the data in it) or one already."""
        return item if isinstance(item, cls) else cls(item, None)


def parse_message(message_type, data: bytes, max_head: int | None = None) -> Received:
    """A received message. When it is laid out as `frame_parts` writes it (the chunk last, its
    data last), protobuf parses all but the data, which stays a view of `data`: not copied twice
    more (into the message, then out of it). Anything else is parsed whole, as protobuf would.

    Finding the chunk reads a key per field (protocols.fields), and protobuf parses in native code
    only the bytes besides the chunk's data, which `max_head` bounds (None: not bounded): a
    message with more is refused before they are parsed. Bytes that do not parse, or any over the
    limit, are a MalformedMessage."""
    view = memoryview(data)
    chunk_at = fields.trailing_field(view, _CHUNK[message_type])
    data_at = fields.trailing_field(view[chunk_at[1] :], _DATA) if chunk_at else None
    data_bytes = len(view) - chunk_at[1] - data_at[1] if data_at else 0
    if max_head is not None and len(view) - data_bytes > max_head:
        raise MalformedMessage(
            f"a {message_type.__name__} of {len(view) - data_bytes} bytes besides its chunk's data (at most {max_head})"
        )
    try:
        if data_at:
            message = message_type.FromString(view[: chunk_at[0]])
            if not message.HasField("chunk"):  # a chunk field twice would merge: left to protobuf
                message.chunk.SetInParent()
                message.chunk.MergeFromString(view[chunk_at[1] : chunk_at[1] + data_at[0]])
                return Received(message, view[chunk_at[1] + data_at[1] :])
        return Received(message_type.FromString(data), None)
    except DecodeError as e:
        raise MalformedMessage(f"a malformed {message_type.__name__}: {e}") from None
