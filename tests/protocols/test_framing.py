"""Payloads framed into checked chunks (protocols.framing): what is written, how it is read back, what is refused."""

from __future__ import annotations

import os
import zlib

import pytest
from _util import frame
from google.protobuf.message import DecodeError

from protocols import stage_pb2 as pb
from protocols.errors import MalformedMessage
from protocols.framing import CHUNK_BYTES, Assembler, ProtocolError, frame_parts, parse_message


def _chunks(payload: bytes) -> list[pb.Chunk]:
    return [m.chunk for m in frame(pb.StageRequest, "micro_batch", pb.MicroBatchHead(), payload)]


def test_framed_parts_are_what_protobuf_writes_and_view_the_payload():
    """frame_parts writes each message as protobuf would (chunk fields filled, then serialized), the
    data a view of the payload, for heads with and without fields and payloads of 0 to 4 chunks."""
    heads = [
        (pb.StageRequest, "micro_batch", pb.MicroBatchHead(to=pb.Address(run_id="r", stage=2), budget_s=3.5)),
        (pb.StageReply, "micro_batch", pb.ResultHead()),
        (pb.StageRequest, "gather", pb.GatherRequest()),
        (pb.StageReply, "error", pb.ErrorReply(message="no")),
    ]
    for size in (0, 1, 300, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 17):
        payload = os.urandom(size)
        count = max(1, -(-size // CHUNK_BYTES))
        for message_type, field, head in heads:
            framed = list(frame_parts(message_type, field, head, payload))
            assert len(framed) == count
            for i, parts in enumerate(framed):
                expected = message_type(**{field: head}) if i == 0 else message_type()
                expected.chunk.index, expected.chunk.count, expected.chunk.total_length, expected.chunk.crc32 = (
                    i,
                    count,
                    size,
                    zlib.crc32(payload),
                )
                expected.chunk.data = payload[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]
                assert b"".join(parts) == expected.SerializeToString(), (size, field, i)
                assert size == 0 or parts[-1].obj is payload  # not a copy


def test_received_messages_keep_their_chunk_data_as_a_view_and_parse_as_protobuf_does():
    """parse_message leaves a framed chunk's data out of the parsed message (a view of the bytes
    received); a message laid out otherwise (chunk first, a field after it, the chunk twice) is
    parsed whole, and garbage is refused as malformed (its sender is to blame), in one line."""
    payload = os.urandom(CHUNK_BYTES + 300)
    head = pb.MicroBatchHead(to=pb.Address(run_id="r", stage=1))
    for parts in frame_parts(pb.StageRequest, "micro_batch", head, payload):
        data = b"".join(parts)
        message, view = parse_message(pb.StageRequest, data)
        assert isinstance(view, memoryview) and view.obj is data and len(view) == len(parts[1])
        assert not message.chunk.data
        message.chunk.data = bytes(view)
        assert message == pb.StageRequest.FromString(data)
    whole = pb.StageRequest(micro_batch=head, chunk=pb.Chunk(index=0, count=1, total_length=3, crc32=7, data=b"abc"))
    chunk_first = whole.chunk.SerializeToString()
    chunk_first = (
        b"\x7a" + bytes([len(chunk_first)]) + chunk_first + pb.StageRequest(micro_batch=head).SerializeToString()
    )
    twice = whole.SerializeToString() + pb.StageRequest(chunk=pb.Chunk(data=b"xyz")).SerializeToString()
    trailing = (
        whole.SerializeToString()
        + pb.StageRequest(micro_batch=pb.MicroBatchHead(to=pb.Address(stage=9))).SerializeToString()
    )
    for data in (chunk_first, twice, trailing):
        message, view = parse_message(pb.StageRequest, data)
        assert view is None and message == pb.StageRequest.FromString(data)
    assert (
        parse_message(pb.StageRequest, twice).message.chunk.data == b"xyz"
        and parse_message(pb.StageRequest, trailing).message.micro_batch.to.stage == 9
    )
    for garbage in (whole.SerializeToString()[:-1], b"\x22\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0f"):
        with pytest.raises(DecodeError):
            pb.StageRequest.FromString(garbage)
        with pytest.raises(MalformedMessage, match="^a malformed StageRequest: [^\n]*$"):
            parse_message(pb.StageRequest, garbage)


def test_bytes_besides_the_chunk_data_are_bounded_before_protobuf_parses_them():
    """A request's head and signature are at most 64 KiB: a message with more bytes besides its
    chunk's data (a head padded with fields, or any message not laid out as frame_parts writes
    it) is refused before protobuf reads them; the data itself is not counted."""
    head = pb.MicroBatchHead(to=pb.Address(run_id="r", stage=1))
    (parts,) = frame_parts(pb.StageRequest, "micro_batch", head, bytes(CHUNK_BYTES))
    framed = b"".join(parts)
    assert parse_message(pb.StageRequest, framed, max_head=1024).data is not None
    big = pb.MicroBatchHead(sender="x" * 4096)
    (parts,) = frame_parts(pb.StageRequest, "micro_batch", big, bytes(CHUNK_BYTES))
    padded = b"".join(parts)
    repeated = pb.StageRequest(micro_batch=head).SerializeToString() + framed  # the head twice: parsed whole
    empty_fields = b"\x08\x00" * (1 << 20)  # 2 MiB of fields, none of them a chunk
    cases = ((padded, len(padded) - CHUNK_BYTES), (repeated, len(repeated)), (empty_fields, len(empty_fields)))
    for data, size in cases:
        with pytest.raises(MalformedMessage, match=f"of {size} bytes besides its chunk's data \\(at most 1024\\)"):
            parse_message(pb.StageRequest, data, max_head=1024)


def test_chunks_verify_length_order_and_checksum():
    payload = os.urandom(3 * 1024 * 1024 + 17)  # > 2 MiB: several chunks
    chunks = _chunks(payload)
    assert len(chunks) == 4 and all(len(c.data) <= 1 << 20 for c in chunks)
    assembler = Assembler()
    assert [assembler.add(c) for c in chunks] == [False, False, False, True]
    assert assembler.payload() == payload
    short = Assembler()
    for c in chunks[:2]:
        short.add(c)
    with pytest.raises(ProtocolError, match="truncated"):
        short.payload()
    out_of_order = Assembler()
    out_of_order.add(chunks[0])
    with pytest.raises(ProtocolError, match="expected chunk 1"):
        out_of_order.add(chunks[2])
    (single,) = _chunks(b"activations")
    single.data = b"activatiOns"
    corrupt = Assembler()
    assert corrupt.add(single)
    with pytest.raises(ProtocolError, match="checksum"):
        corrupt.payload()
