"""Fields found by hand (protocols.fields): finding a message's last field reads one key per field
of a well-formed message and stops at the first key no honest writer makes (issue 58: a stranger's
zero-filled 2 MiB message walked one Python iteration per two bytes, 2.3 s on a stage's event loop)."""

from __future__ import annotations

import pytest

from protocols import fields
from protocols import stage_pb2 as pb
from protocols.framing import frame_parts


@pytest.fixture
def keys_read(monkeypatch) -> list:
    """Every varint `trailing_field` reads (its keys and lengths), as it reads them."""
    read = []
    varint_at = fields._varint_at

    def counted(buf, pos):
        read.append(pos)
        return varint_at(buf, pos)

    monkeypatch.setattr(fields, "_varint_at", counted)
    return read


def test_zeros_stop_at_the_first_key(keys_read):
    """Zero bytes read as field 0, which protobuf has not: one key read of a 2 MiB buffer."""
    assert fields.trailing_field(memoryview(bytes(2 << 20)), 15) is None
    assert len(keys_read) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"\x0f" + bytes(1 << 20),  # wire type 7: protobuf has no such type
        b"\x0e" + bytes(1 << 20),  # wire type 6
        b"\x0b" + bytes(1 << 20),  # a group: no message here has one
        b"\x7a\xff\xff\x7f" + bytes(1 << 20),  # field 15, a length past the end
        b"\x08\x00" * (1 << 20),  # field 1 again and again: protobuf writes each field once, in number order
        b"\x7a\x00\x0a\x00" + bytes(1 << 20),  # field 1 after field 15
    ],
    ids=["wire type 7", "wire type 6", "group", "length past the end", "a field repeated", "fields out of order"],
)
def test_a_key_no_honest_writer_makes_ends_the_search(keys_read, data):
    assert fields.trailing_field(memoryview(data), 15) is None
    assert len(keys_read) <= 4


def test_a_framed_message_costs_one_key_per_field(keys_read):
    """The message frame_parts writes: head, signature and chunk; a 1 MiB chunk's data is skipped
    by its length, so the keys read do not grow with the bytes."""
    head = pb.MicroBatchHead(to=pb.Address(run_id="r", stage=1), sender="s" * 40)
    auth = pb.Auth(signature=b"x" * 256)
    (parts,) = frame_parts(pb.StageRequest, "micro_batch", head, bytes(1 << 20), auth=auth)
    data = memoryview(b"".join(parts))
    found = fields.trailing_field(data, 15)
    assert found is not None and pb.StageRequest.FromString(data[: found[0]]).auth == auth
    assert len(keys_read) == 2 * 3  # a key and a length for each of the three fields
