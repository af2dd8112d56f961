"""`Encoded` <-> bytes of a `CompressedTensor` message, validated before anything is allocated.

The payload is the serialized message followed by its `checksum` field (field 15, fixed32): the
crc32 of every byte before it, header fields included. A truncated or corrupted payload (in a
buffer, a shape, a dtype or a state stamp) is caught here rather than trusted (hivemind's stream
reassembly does not check lengths). `buffer_length` also counts the buffers' bytes. Values (Raw,
Quantized) are read and written by `protocols.values`, low-rank and subspace bodies by
`protocols.factored`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from protocols import compressed_tensor_pb2 as pb
from protocols import factored, fields, indices
from protocols.checksum import crc32
from protocols.errors import PayloadError
from protocols.message import Encoded, LowRankPart, QuantPart, RawPart, SparsePart, StateStamp, SubspacePart
from protocols.values import (
    DTYPES,
    BufferBytes,
    buffer_field,
    buffer_of,
    dtype_of,
    extremes,
    from_bytes,
    matrix_of,
    quant_from,
    quant_groups,
    quant_segments,
    raw_from,
    raw_segments,
    rows_of,
    values_from,
    values_segments,
)
from protocols.version import PROTOCOL_VERSION

__all__ = ["DEFAULT_LIMITS", "DecodeLimits", "decode", "encode", "matrix_of", "quant_groups", "rows_of"]


_CODINGS = {"bitmap": pb.BITMAP, "varint": pb.DELTA_VARINT}


@dataclass(frozen=True)
class DecodeLimits:
    """What a receiver accepts; anything larger is refused before allocation.

    `max_elements` bounds the decoded tensor (a TopK payload of a few bytes can describe a huge
    dense tensor): 2**29 elements, what a 1 GiB payload holds of an exact fp16/bf16 tensor (a stage
    peer derives both from its `max_micro_batch_bytes`: Settings.limits.decode_limits).
    """

    max_elements: int = 1 << 29
    max_payload_bytes: int = 1 << 31
    max_rank: int = 8


DEFAULT_LIMITS = DecodeLimits()


_CHECKSUM_TAG = bytes([(15 << 3) | 5])  # field 15, wire type fixed32: the last 5 bytes of a payload


# ---- encode --------------------------------------------------------------------------------------
#
# The payload is assembled by hand from segments, with a single copy of each buffer (the final
# join, protocols.fields): building it with protobuf copied every buffer three more times (the
# tensor's bytes, the field assignment, the serialization; docs/bench, "Network CPU per byte").
# tests/test_wire.py re-serializes every kind of payload to the same bytes.


def _sparse_segments(part: SparsePart, total: int, check: BufferBytes) -> tuple[list, int]:
    """The Sparse message's segments and the digest of its indices (sent, or reused)."""
    if part.positions is None:
        coding, raw, digest = pb.REUSED, memoryview(b""), part.index_digest
    else:
        name, data = indices.encode_indices(part.positions, total)
        coding, raw = _CODINGS[name], buffer_of(data)
        digest = crc32(raw)
    values = values_segments(5, part.values, check)
    segments = [
        pb.Sparse(kept_per_sample=part.kept_per_sample, index_coding=coding).SerializeToString(),
        *buffer_field(3, raw, check),
        pb.Sparse(index_digest=digest if part.positions is None else 0).SerializeToString(),
        *values,
    ]
    return segments, digest


def _body_segments(enc: Encoded, check: BufferBytes) -> tuple[int, list]:
    """The body's field number in CompressedTensor and its segments."""
    body = enc.body
    if isinstance(body, RawPart):
        return 4, raw_segments(body, check)
    if isinstance(body, QuantPart):
        return 5, quant_segments(body, check)
    if isinstance(body, LowRankPart):
        return 8, factored.low_rank_segments(body, check)
    if isinstance(body, SubspacePart):
        return 9, factored.subspace_segments(body, check)
    sparse, enc.index_digest = _sparse_segments(body, enc.numel, check)
    return 6, sparse


def encode(enc: Encoded) -> bytes:
    """Serialize; also records the index digest on `enc` for reused-index replies."""
    check = BufferBytes()
    number, body = _body_segments(enc, check)
    body = fields.length_delimited(number, body)
    stamp = pb.CompressedTensor()
    if enc.stamp is not None:
        stamp.state.version = enc.stamp.version
        stamp.state.sample_versions.extend(enc.stamp.sample_versions)
        stamp.state.warmup = enc.stamp.warmup
    # protobuf writes fields in number order: the stamp (7) after most bodies, before a low-rank (8) or subspace (9) one
    stamped = [*body, stamp.SerializeToString()] if number < 7 else [stamp.SerializeToString(), *body]
    segments = [
        pb.CompressedTensor(
            format_version=PROTOCOL_VERSION, shape=enc.shape, dtype=DTYPES[enc.dtype]
        ).SerializeToString(),
        *stamped,
        pb.CompressedTensor(buffer_length=check.length).SerializeToString(),
    ]
    digest = 0
    for segment in segments:
        digest = crc32(segment, digest)
    return b"".join((*segments, _CHECKSUM_TAG, digest.to_bytes(4, "little")))


# ---- decode --------------------------------------------------------------------------------------


def _sparse_from(msg: pb.Sparse, shape: tuple[int, ...], check: BufferBytes) -> SparsePart:
    total = math.prod(shape)
    rows = rows_of(shape)
    per_row = total // rows if rows else 0
    k = msg.kept_per_sample
    if k > per_row:
        raise PayloadError(f"TopK keeps {k} values per sample out of {per_row}")
    kept = k * rows
    values = values_from(msg, "values", (rows, k), check, "TopK values")
    index_bytes = check.add(msg.indices)
    if msg.index_coding == pb.REUSED:
        if index_bytes:
            raise PayloadError("reused-index payload carries indices")
        return SparsePart(k, None, values, msg.index_digest)
    data = from_bytes(index_bytes, torch.uint8)
    if msg.index_coding == pb.BITMAP:
        positions = indices.decode_bitmap(data, total)
        if positions.numel() != kept:
            raise PayloadError(f"bitmap marks {positions.numel()} values, expected {kept}")
    elif msg.index_coding == pb.DELTA_VARINT:
        positions = indices.decode_varint(data, kept, total)
    else:
        raise PayloadError(f"unknown index coding {msg.index_coding}")
    if kept:  # positions increase: every sample holds k of them iff the r-th k lie in sample r
        chunks = positions.view(rows, k)
        firsts = torch.arange(rows) * per_row
        if not bool(((chunks[:, 0] >= firsts) & (chunks[:, -1] < firsts + per_row)).all()):
            raise PayloadError(f"TopK indices do not mark {k} values in every sample")
    return SparsePart(k, positions, values, crc32(index_bytes))


def _check_finite(part: RawPart | QuantPart, dtype: torch.dtype) -> None:
    """Every value the part can decode to is finite in the tensor's dtype (a finite quantization
    range can still overflow a narrower dtype)."""
    values = extremes(part)
    if values.numel() and not bool(torch.isfinite(values.to(dtype)).all()):
        raise PayloadError(f"values are not finite as {str(dtype).removeprefix('torch.')}")


def decode(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> Encoded:
    """Parse and validate a payload; raises PayloadError with a one-line reason."""
    if len(payload) > limits.max_payload_bytes:
        raise PayloadError(f"payload of {len(payload)} bytes exceeds the limit of {limits.max_payload_bytes}")
    if len(payload) < 5 or payload[-5:-4] != _CHECKSUM_TAG:
        raise PayloadError("payload is truncated: it does not end with its checksum")
    if crc32(memoryview(payload)[:-5]) != int.from_bytes(payload[-4:], "little"):
        raise PayloadError("payload checksum mismatch")
    msg = pb.CompressedTensor()
    try:
        msg.ParseFromString(payload)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise PayloadError(f"payload is not a CompressedTensor: {e}") from None
    if msg.format_version != PROTOCOL_VERSION:
        raise PayloadError(f"unsupported format version {msg.format_version} (this peer reads {PROTOCOL_VERSION})")
    if len(msg.shape) > limits.max_rank:  # before a Python loop over a list of any length
        raise PayloadError(f"tensor rank {len(msg.shape)} exceeds the limit of {limits.max_rank}")
    shape = tuple(int(d) for d in msg.shape)
    numel = math.prod(shape)
    if numel > limits.max_elements or any(d > limits.max_elements for d in shape):
        raise PayloadError(f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    dtype = dtype_of(msg.dtype, "dtype")
    if not (msg.HasField("buffer_length") and msg.HasField("checksum")):
        raise PayloadError("payload is truncated: it has no length and checksum")
    check = BufferBytes()
    which = msg.WhichOneof("body")
    if which == "raw":
        body: RawPart | QuantPart | SparsePart | LowRankPart | SubspacePart = raw_from(msg.raw, numel, check)
    elif which == "quantized":
        body = quant_from(msg.quantized, shape, check)
    elif which == "sparse":
        body = _sparse_from(msg.sparse, shape, check)
    elif which == "low_rank":
        body = factored.low_rank_from(msg.low_rank, shape, check)
    elif which == "subspace":
        body = factored.subspace_from(msg.subspace, shape, check)
    else:
        raise PayloadError("payload has no body")
    if check.length != msg.buffer_length:
        raise PayloadError(f"payload carries {check.length} buffer bytes, header says {msg.buffer_length}")
    if isinstance(body, LowRankPart):
        factored.check_low_rank_finite(body)
    elif isinstance(body, SubspacePart):
        factored.check_subspace_finite(body)
    else:
        _check_finite(body.values if isinstance(body, SparsePart) else body, dtype)
    stamp = None
    if len(msg.state.sample_versions) > rows_of(shape):  # a version per sample, at most
        raise PayloadError(f"{len(msg.state.sample_versions)} state versions for {rows_of(shape)} samples")
    if msg.HasField("state"):
        stamp = StateStamp(msg.state.version, tuple(msg.state.sample_versions), msg.state.warmup)
    enc = Encoded(shape, dtype, body, stamp)
    if isinstance(body, SparsePart) and body.positions is not None:
        enc.index_digest = body.index_digest
    return enc
