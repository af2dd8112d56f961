"""A micro-batch request's payload: what the micro-batch carries (a `Carried` message of
stage.proto: sample ids, targets, stage 0's input) ahead of its activations.

Layout: the Carried message's length (8 bytes, little-endian), the message, then the activations
(a CompressedTensor's bytes; nothing for stage 0). They ride in the payload, not the head, so they
are chunked, checksummed and counted against the sender's byte limits like any payload, and a
micro-batch of any size its config allows fits; the head stays small.
"""

from __future__ import annotations

import hashlib

from google.protobuf.message import DecodeError

from protocols import stage_pb2 as pb
from protocols.errors import PayloadError

LENGTH_BYTES = 8


def pack(carried: pb.Carried, body: bytes | memoryview = b"") -> bytes:
    """The payload: `carried`, then `body` (the activations)."""
    head = carried.SerializeToString()
    return b"".join((len(head).to_bytes(LENGTH_BYTES, "little"), head, body))


def payload_sha256(carried: pb.Carried, body: bytes | memoryview = b"") -> bytes:
    """The SHA-256 of `pack(carried, body)`, without building the payload (no copy of `body`)."""
    head = carried.SerializeToString()
    digest = hashlib.sha256(len(head).to_bytes(LENGTH_BYTES, "little"))
    digest.update(head)
    digest.update(body)
    return digest.digest()


def unpack(payload: bytes | memoryview) -> tuple[pb.Carried, memoryview]:
    """The carried tensors and a view of the activations (not copied); PayloadError when the
    layout is broken."""
    view = memoryview(payload)
    if len(view) < LENGTH_BYTES:
        raise PayloadError(f"a micro-batch payload of {len(view)} bytes has no room for what it carries")
    length = int.from_bytes(view[:LENGTH_BYTES], "little")
    if length > len(view) - LENGTH_BYTES:
        raise PayloadError(f"carried tensors of {length} bytes in a micro-batch payload of {len(view)} bytes")
    carried = pb.Carried()
    try:
        carried.ParseFromString(view[LENGTH_BYTES : LENGTH_BYTES + length])
    except (DecodeError, RuntimeError, ValueError) as e:
        raise PayloadError(f"carried tensors are not a Carried message: {e}") from None
    return carried, view[LENGTH_BYTES + length :]
