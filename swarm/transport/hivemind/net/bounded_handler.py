"""A hivemind protobuf stream handler that reads no request message past a size limit.

`P2P.add_protobuf_handler` (hivemind 1.1.12) reads a request's 8-byte length and then that many
bytes, whatever the length says: a stranger who declares 2^40 bytes and streams makes the peer
hold what it sends until the stream ends (measured: 256 MiB streamed raised a stage peer's RSS by
335 MiB). Served here instead, on the same wire format, so hivemind's callers (the all-reduce
runners of the other replicas) talk to it unchanged: a length over the limit is answered with an
error and the stream closes before any of the message is read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto.p2pd_pb2 import RPCError

from protocols.errors import MalformedMessage, one_line
from protocols.framing import ProtocolError

PREFETCH = 5  # requests read ahead of the handler


async def read_request(reader: asyncio.StreamReader, request_type, limit: int):
    """The next request message, or None at the caller's end of stream (an error marker);
    ProtocolError for a length over `limit`, before any of it is read, and for bytes that do not
    parse (in native code: at most `limit` of them)."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise ProtocolError(f"a message marker {marker!r}: expected a message or the end of the stream")
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > limit:
        raise ProtocolError(f"a message of {length} bytes: this handler takes at most {limit}")
    data = await reader.readexactly(length)
    if marker == P2P.ERROR_MARKER:
        return None
    try:
        return request_type.FromString(data)
    except DecodeError as e:
        raise MalformedMessage(f"a malformed {request_type.__name__}: {e}") from None


def bounded_stream_handler(p2p: P2P, name: str, handler: Callable, request_type, limit: int):
    """The binary stream handler serving `handler(requests, context)` (an async generator of
    replies, as hivemind's stream-in, stream-out protobuf handlers are)."""

    async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
        queue: asyncio.Queue = asyncio.Queue(PREFETCH)

        async def requests() -> AsyncIterator:
            while (request := await queue.get()) is not None:
                yield request

        async def respond() -> None:
            try:
                async for reply in handler(requests(), context):
                    await P2P.send_protobuf(reply, writer)
            except Exception as e:  # the caller hears why, as from hivemind's handlers
                with contextlib.suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=one_line(e)), writer)

        with contextlib.closing(writer):
            responding = asyncio.create_task(respond())
            try:
                while True:
                    reading = asyncio.ensure_future(read_request(reader, request_type, limit))
                    await asyncio.wait({responding, reading}, return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():  # the handler finished first
                        reading.cancel()
                        return
                    try:
                        request = reading.result()
                    except asyncio.IncompleteReadError:  # the caller closed its end
                        return
                    except ProtocolError as e:
                        with contextlib.suppress(Exception):
                            await P2P.send_protobuf(RPCError(message=one_line(e)), writer)
                        return
                    await queue.put(request)
                    if request is None:  # the caller's end of stream: the handler finishes its replies
                        await responding
                        return
            finally:
                responding.cancel()

    return serve


async def add_bounded_handlers(servicer: ServicerBase, p2p: P2P, namespace: str, limit: int) -> None:
    """`servicer.add_p2p_handlers(p2p, namespace=namespace)` for stream-in, stream-out rpc_*
    handlers, each message of a request at most `limit` bytes."""
    servicer._collect_rpc_handlers()
    for rpc in servicer._rpc_handlers:
        if not (rpc.stream_input and rpc.stream_output):
            raise TypeError(f"{rpc.method_name}: only stream-in, stream-out handlers are served bounded")
        name = servicer._get_handle_name(namespace, rpc.method_name)
        serve = bounded_stream_handler(p2p, name, getattr(servicer, rpc.method_name), rpc.request_type, limit)
        await p2p.add_binary_stream_handler(name, serve)
