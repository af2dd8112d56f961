"""What a refused caller's bytes cost a stage peer: the drain after a refusal and the all-reduce
handler read no more than a legitimate request could hold (swarm.transport.hivemind.net)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from protocols.framing import CHUNK_BYTES, ProtocolError
from swarm.transport.hivemind.net.bounded_handler import read_request
from swarm.transport.hivemind.net.streams import Requests


def _message(data: bytes) -> bytes:
    return P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


def _end() -> bytes:
    return P2P.ERROR_MARKER + bytes(P2P.HEADER_LEN)


async def _left_after_drain(data: bytes, limit: int) -> int:
    reader = asyncio.StreamReader(limit=len(data) + 1)
    reader.feed_data(data)
    reader.feed_eof()
    await Requests(reader).drain(5.0, limit)
    return len(await reader.read())


def test_the_drain_skips_the_rest_of_a_request_up_to_the_callers_end():
    rest = _message(b"x" * CHUNK_BYTES) + _message(b"y" * 1000)
    after = b"next stream bytes"
    # it stops at the end marker (the stream closes next: what follows the marker is never read)
    assert asyncio.run(_left_after_drain(rest + _end() + after, 4 * CHUNK_BYTES)) == P2P.HEADER_LEN + len(after)


def test_zeros_after_a_refusal_end_the_drain_at_once():
    """Zeros frame as empty messages: no request has one, so the drain stops there (it used to parse
    them one after another without yielding, and a stage peer froze for 30 s)."""
    zeros = bytes(8 << 20)
    assert asyncio.run(_left_after_drain(_message(b"z" * 100) + zeros, 64 << 20)) == len(zeros) - P2P.HEADER_LEN - 1


def test_the_drain_reads_no_more_than_its_limit():
    big = _message(b"a" * (3 << 20))  # one message over what the refused request could hold
    assert asyncio.run(_left_after_drain(big, 2 << 20)) == len(big) - 1 - P2P.HEADER_LEN


def test_the_all_reduce_handler_refuses_an_absurd_length_before_reading_it():
    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_request(reader, averaging_pb2.AveragingData, 1 << 20)

    part = averaging_pb2.AveragingData(group_id=b"g", weight=1.0)
    assert asyncio.run(read(_message(part.SerializeToString()))) == part
    assert asyncio.run(read(_end())) is None
    huge = P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    with pytest.raises(ProtocolError, match="a message of 1099511627776 bytes"):
        asyncio.run(read(huge))
    with pytest.raises(ProtocolError, match="message marker"):
        asyncio.run(read(b"\x07" + bytes(8)))
    with pytest.raises(ProtocolError, match="^a malformed AveragingData: "):  # one line to the caller
        asyncio.run(read(_message(bytes(1 << 16))))
