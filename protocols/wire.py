"""`Encoded` <-> bytes of a `CompressedTensor` message, validated before anything is allocated.

The payload is the serialized message followed by its `checksum` field (field 15, fixed32): the
crc32 of every byte before it, header fields included. A truncated or corrupted payload (in a
buffer, a shape, a dtype or a state stamp) is caught here rather than trusted (hivemind's stream
reassembly does not check lengths). `buffer_length` also counts the buffers' bytes.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from protocols import bitpack, fields, indices
from protocols import compressed_tensor_pb2 as pb
from protocols.checksum import crc32
from protocols.errors import PayloadError
from protocols.message import Encoded, Granularity, LowRankPart, QuantPart, RawPart, SparsePart, StateStamp
from protocols.version import PROTOCOL_VERSION

# torch.frombuffer warns on every read-only buffer (received bytes are): the decoders copy before
# writing. A filter, not `catch_warnings` around each call: that is not thread-safe, and leaving it
# resets every module's record of warnings already shown, so each warning came back on every payload.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_DTYPES = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float64: pb.FLOAT64,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_GRANULARITY = {
    Granularity.TENSOR: pb.PER_TENSOR,
    Granularity.SAMPLE: pb.PER_SAMPLE,
    Granularity.CHANNEL: pb.PER_CHANNEL,
}
_GRANULARITY_BACK = {v: k for k, v in _GRANULARITY.items()}
_CODINGS = {"bitmap": pb.BITMAP, "varint": pb.DELTA_VARINT}
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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


def rows_of(shape: tuple[int, ...]) -> int:
    """Samples in a tensor: its first dimension, or 1 for scalars and vectors."""
    return shape[0] if len(shape) >= 2 else 1


def matrix_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor seen as a matrix: its last dimension by the product of the others
    (a scalar is 1 x 1), as a low-rank payload factors it."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def quant_groups(shape: tuple[int, ...], granularity: Granularity) -> int:
    """Number of (low, step) pairs a quantized tensor of this shape carries."""
    numel = math.prod(shape)
    if numel == 0:
        return 0
    if granularity is Granularity.TENSOR:
        return 1
    if granularity is Granularity.CHANNEL and len(shape) >= 3:
        return shape[0] * shape[1]
    return rows_of(shape)


# ---- tensors <-> bytes -------------------------------------------------------------------------


def _buffer(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, not copied when it is contiguous on the CPU (`encode` copies them once, joining the payload)."""
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A read-only view of received bytes; every decoder copies before writing."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


class _BufferBytes:
    """Counts the bytes of the buffer fields as they are written or read (for buffer_length).

    Read each buffer field once, through `add`: upb copies a bytes field on every access."""

    def __init__(self) -> None:
        self.length = 0

    def add(self, data: bytes | memoryview) -> bytes | memoryview:
        self.length += len(data)
        return data


_CHECKSUM_TAG = bytes([(15 << 3) | 5])  # field 15, wire type fixed32: the last 5 bytes of a payload


# ---- encode --------------------------------------------------------------------------------------
#
# The payload is assembled by hand from segments, with a single copy of each buffer (the final
# join, protocols.fields): building it with protobuf copied every buffer three more times (the
# tensor's bytes, the field assignment, the serialization; docs/bench, "Network CPU per byte").
# tests/test_wire.py re-serializes every kind of payload to the same bytes.


def _buffer_field(number: int, data: memoryview, check: _BufferBytes) -> list:
    return fields.bytes_field(number, check.add(data))


def _raw_segments(part: RawPart, check: _BufferBytes) -> list:
    if part.data.dtype not in _DTYPES:
        raise TypeError(f"cannot send dtype {part.data.dtype}")
    return [
        pb.Raw(wire_dtype=_DTYPES[part.data.dtype]).SerializeToString(),
        *_buffer_field(2, _buffer(part.data), check),
    ]


def _quant_segments(part: QuantPart, check: _BufferBytes) -> list:
    return [
        pb.Quantized(bits=part.bits, granularity=_GRANULARITY[part.granularity]).SerializeToString(),
        *_buffer_field(3, _buffer(bitpack.pack(part.codes, part.bits)), check),
        *_buffer_field(4, _buffer(part.lows.float()), check),
        *_buffer_field(5, _buffer(part.steps.float()), check),
    ]


def _values_segments(raw_number: int, part: RawPart | QuantPart, check: _BufferBytes) -> list:
    """Values in a `oneof` of a raw field `raw_number` and a quantized one numbered next."""
    if isinstance(part, QuantPart):
        return fields.length_delimited(raw_number + 1, _quant_segments(part, check))
    return fields.length_delimited(raw_number, _raw_segments(part, check))


def _low_rank_segments(part: LowRankPart, check: _BufferBytes) -> list:
    return [
        pb.LowRank(rank=part.rank).SerializeToString(),
        *_values_segments(2, part.left, check),
        *_values_segments(4, part.right, check),
    ]


def _sparse_segments(part: SparsePart, total: int, check: _BufferBytes) -> tuple[list, int]:
    """The Sparse message's segments and the digest of its indices (sent, or reused)."""
    if part.positions is None:
        coding, raw, digest = pb.REUSED, memoryview(b""), part.index_digest
    else:
        name, data = indices.encode_indices(part.positions, total)
        coding, raw = _CODINGS[name], _buffer(data)
        digest = crc32(raw)
    values = _values_segments(5, part.values, check)
    segments = [
        pb.Sparse(kept_per_sample=part.kept_per_sample, index_coding=coding).SerializeToString(),
        *_buffer_field(3, raw, check),
        pb.Sparse(index_digest=digest if part.positions is None else 0).SerializeToString(),
        *values,
    ]
    return segments, digest


def _body_segments(enc: Encoded, check: _BufferBytes) -> tuple[int, list]:
    """The body's field number in CompressedTensor and its segments."""
    body = enc.body
    if isinstance(body, RawPart):
        return 4, _raw_segments(body, check)
    if isinstance(body, QuantPart):
        return 5, _quant_segments(body, check)
    if isinstance(body, LowRankPart):
        return 8, _low_rank_segments(body, check)
    sparse, enc.index_digest = _sparse_segments(body, enc.numel, check)
    return 6, sparse


def encode(enc: Encoded) -> bytes:
    """Serialize; also records the index digest on `enc` for reused-index replies."""
    check = _BufferBytes()
    number, body = _body_segments(enc, check)
    body = fields.length_delimited(number, body)
    stamp = pb.CompressedTensor()
    if enc.stamp is not None:
        stamp.state.version = enc.stamp.version
        stamp.state.sample_versions.extend(enc.stamp.sample_versions)
        stamp.state.warmup = enc.stamp.warmup
    # protobuf writes fields in number order: the stamp (7) after most bodies, before a low-rank one (8)
    stamped = [*body, stamp.SerializeToString()] if number < 7 else [stamp.SerializeToString(), *body]
    segments = [
        pb.CompressedTensor(
            format_version=PROTOCOL_VERSION, shape=enc.shape, dtype=_DTYPES[enc.dtype]
        ).SerializeToString(),
        *stamped,
        pb.CompressedTensor(buffer_length=check.length).SerializeToString(),
    ]
    digest = 0
    for segment in segments:
        digest = crc32(segment, digest)
    return b"".join((*segments, _CHECKSUM_TAG, digest.to_bytes(4, "little")))


# ---- decode --------------------------------------------------------------------------------------


def _expect_length(what: str, data: bytes, expected: int) -> None:
    if len(data) != expected:
        raise PayloadError(f"{what} has {len(data)} bytes, expected {expected}")


def _dtype(value: int, what: str) -> torch.dtype:
    if value not in _TORCH_DTYPES:
        raise PayloadError(f"unknown {what} {value}")
    return _TORCH_DTYPES[value]


def _raw_from(msg: pb.Raw, count: int, check: _BufferBytes) -> RawPart:
    dtype = _dtype(msg.wire_dtype, "wire dtype")
    data = check.add(msg.data)
    _expect_length("raw data", data, count * dtype.itemsize)
    return RawPart(_from_bytes(data, dtype))


def _quant_from(msg: pb.Quantized, shape: tuple[int, ...], check: _BufferBytes) -> QuantPart:
    if not 1 <= msg.bits <= 8:
        raise PayloadError(f"quantization bits {msg.bits} out of range 1..8")
    if msg.granularity not in _GRANULARITY_BACK:
        raise PayloadError(f"unknown quantization granularity {msg.granularity}")
    granularity = _GRANULARITY_BACK[msg.granularity]
    count = math.prod(shape)
    groups = quant_groups(shape, granularity)
    codes, lows, steps = check.add(msg.codes), check.add(msg.lows), check.add(msg.steps)
    _expect_length("quantized codes", codes, bitpack.packed_length(count, msg.bits))
    _expect_length("quantization lows", lows, 4 * groups)
    _expect_length("quantization steps", steps, 4 * groups)
    lows = _from_bytes(lows, torch.float32)
    steps = _from_bytes(steps, torch.float32)
    if not (bool(torch.isfinite(lows).all()) and bool(torch.isfinite(steps).all())):
        raise PayloadError("quantization ranges are not finite")
    codes = bitpack.unpack(_from_bytes(codes, torch.uint8), msg.bits, count)
    return QuantPart(msg.bits, granularity, codes, lows, steps)


def _sparse_from(msg: pb.Sparse, shape: tuple[int, ...], check: _BufferBytes) -> SparsePart:
    total = math.prod(shape)
    rows = rows_of(shape)
    per_row = total // rows if rows else 0
    k = msg.kept_per_sample
    if k > per_row:
        raise PayloadError(f"TopK keeps {k} values per sample out of {per_row}")
    kept = k * rows
    values = _values_from(msg, "values", (rows, k), check, "TopK values")
    index_bytes = check.add(msg.indices)
    if msg.index_coding == pb.REUSED:
        if index_bytes:
            raise PayloadError("reused-index payload carries indices")
        return SparsePart(k, None, values, msg.index_digest)
    data = _from_bytes(index_bytes, torch.uint8)
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


def _extremes(part: RawPart | QuantPart) -> torch.Tensor:
    """Values that bound what the part decodes to: raw values, a quantized group's lowest and highest level."""
    if isinstance(part, RawPart):
        return part.data
    return torch.cat([part.lows, part.lows + part.steps * ((1 << part.bits) - 1)])


def _values_from(msg, oneof: str, shape: tuple[int, ...], check: _BufferBytes, what: str) -> RawPart | QuantPart:
    """The raw or quantized values of `shape` set in the message's `oneof`."""
    which = msg.WhichOneof(oneof)
    if which is None:
        raise PayloadError(f"payload has no {what}")
    if which.startswith("quantized"):
        return _quant_from(getattr(msg, which), shape, check)
    return _raw_from(getattr(msg, which), math.prod(shape), check)


def _low_rank_from(msg: pb.LowRank, shape: tuple[int, ...], check: _BufferBytes) -> LowRankPart:
    rows, cols = matrix_of(shape)
    if msg.rank > min(rows, cols):  # also bounds each factor by the tensor's element count
        raise PayloadError(f"low-rank payload of rank {msg.rank} for a {rows} x {cols} matrix")
    left = _values_from(msg, "left", (msg.rank, rows), check, "low-rank left factor")
    right = _values_from(msg, "right", (msg.rank, cols), check, "low-rank right factor")
    return LowRankPart(msg.rank, left, right)


def _check_finite(part: RawPart | QuantPart, dtype: torch.dtype) -> None:
    """Every value the part can decode to is finite in the tensor's dtype (a finite quantization
    range can still overflow a narrower dtype)."""
    values = _extremes(part)
    if values.numel() and not bool(torch.isfinite(values.to(dtype)).all()):
        raise PayloadError(f"values are not finite as {str(dtype).removeprefix('torch.')}")


def _largest(part: RawPart | QuantPart) -> float:
    values = _extremes(part)
    return float(values.double().abs().max()) if values.numel() else 0.0


def _check_low_rank_finite(part: LowRankPart) -> None:
    """The factors are finite and their product, computed in float32, cannot overflow: each
    element is a sum of `rank` products of one value of each factor. (A decoder saturates what a
    narrower dtype cannot hold.)"""
    bound = part.rank * _largest(part.left) * _largest(part.right)
    if not bound <= _FLOAT32_MAX:  # also NaN
        raise PayloadError("low-rank factors are not finite, or their product overflows float32")


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
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) > limits.max_rank:
        raise PayloadError(f"tensor rank {len(shape)} exceeds the limit of {limits.max_rank}")
    numel = math.prod(shape)
    if numel > limits.max_elements or any(d > limits.max_elements for d in shape):
        raise PayloadError(f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    dtype = _dtype(msg.dtype, "dtype")
    if not (msg.HasField("buffer_length") and msg.HasField("checksum")):
        raise PayloadError("payload is truncated: it has no length and checksum")
    check = _BufferBytes()
    which = msg.WhichOneof("body")
    if which == "raw":
        body: RawPart | QuantPart | SparsePart | LowRankPart = _raw_from(msg.raw, numel, check)
    elif which == "quantized":
        body = _quant_from(msg.quantized, shape, check)
    elif which == "sparse":
        body = _sparse_from(msg.sparse, shape, check)
    elif which == "low_rank":
        body = _low_rank_from(msg.low_rank, shape, check)
    else:
        raise PayloadError("payload has no body")
    if check.length != msg.buffer_length:
        raise PayloadError(f"payload carries {check.length} buffer bytes, header says {msg.buffer_length}")
    if isinstance(body, LowRankPart):
        _check_low_rank_finite(body)
    else:
        _check_finite(body.values if isinstance(body, SparsePart) else body, dtype)
    stamp = None
    if msg.HasField("state"):
        stamp = StateStamp(msg.state.version, tuple(msg.state.sample_versions), msg.state.warmup)
    enc = Encoded(shape, dtype, body, stamp)
    if isinstance(body, SparsePart) and body.positions is not None:
        enc.index_digest = body.index_digest
    return enc
