"""Values on the wire: the Raw and Quantized messages every body is made of, and tensor shapes.

Shared by `protocols.wire` (raw, quantized and TopK bodies) and `protocols.factored` (low-rank and
subspace bodies). Buffers are written as segments joined once (`protocols.fields`) and read as
views of the received bytes; `BufferBytes` counts them for the payload's buffer_length.
"""

from __future__ import annotations

import math
import warnings

import torch

from protocols import bitpack, fields
from protocols import compressed_tensor_pb2 as pb
from protocols.errors import PayloadError
from protocols.message import Granularity, QuantPart, RawPart

# torch.frombuffer warns on every read-only buffer (received bytes are): the decoders copy before
# writing. A filter, not `catch_warnings` around each call: that is not thread-safe, and leaving it
# resets every module's record of warnings already shown, so each warning came back on every payload.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DTYPES = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float64: pb.FLOAT64,
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
_GRANULARITY = {
    Granularity.TENSOR: pb.PER_TENSOR,
    Granularity.SAMPLE: pb.PER_SAMPLE,
    Granularity.CHANNEL: pb.PER_CHANNEL,
}
_GRANULARITY_BACK = {v: k for k, v in _GRANULARITY.items()}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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


def buffer_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, not copied when it is contiguous on the CPU (`encode` copies them once, joining the payload)."""
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A read-only view of received bytes; every decoder copies before writing."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


class BufferBytes:
    """Counts the bytes of the buffer fields as they are written or read (for buffer_length).

    Read each buffer field once, through `add`: upb copies a bytes field on every access."""

    def __init__(self) -> None:
        self.length = 0

    def add(self, data: bytes | memoryview) -> bytes | memoryview:
        self.length += len(data)
        return data


def buffer_field(number: int, data: memoryview, check: BufferBytes) -> list:
    return fields.bytes_field(number, check.add(data))


def raw_segments(part: RawPart, check: BufferBytes) -> list:
    if part.data.dtype not in DTYPES:
        raise TypeError(f"cannot send dtype {part.data.dtype}")
    return [
        pb.Raw(wire_dtype=DTYPES[part.data.dtype]).SerializeToString(),
        *buffer_field(2, buffer_of(part.data), check),
    ]


def quant_segments(part: QuantPart, check: BufferBytes) -> list:
    return [
        pb.Quantized(bits=part.bits, granularity=_GRANULARITY[part.granularity]).SerializeToString(),
        *buffer_field(3, buffer_of(bitpack.pack(part.codes, part.bits)), check),
        *buffer_field(4, buffer_of(part.lows.float()), check),
        *buffer_field(5, buffer_of(part.steps.float()), check),
    ]


def values_segments(raw_number: int, part: RawPart | QuantPart, check: BufferBytes) -> list:
    """Values in a `oneof` of a raw field `raw_number` and a quantized one numbered next."""
    if isinstance(part, QuantPart):
        return fields.length_delimited(raw_number + 1, quant_segments(part, check))
    return fields.length_delimited(raw_number, raw_segments(part, check))


def expect_length(what: str, data: bytes, expected: int) -> None:
    if len(data) != expected:
        raise PayloadError(f"{what} has {len(data)} bytes, expected {expected}")


def dtype_of(value: int, what: str) -> torch.dtype:
    if value not in TORCH_DTYPES:
        raise PayloadError(f"unknown {what} {value}")
    return TORCH_DTYPES[value]


def raw_from(msg: pb.Raw, count: int, check: BufferBytes) -> RawPart:
    dtype = dtype_of(msg.wire_dtype, "wire dtype")
    data = check.add(msg.data)
    expect_length("raw data", data, count * dtype.itemsize)
    return RawPart(from_bytes(data, dtype))


def quant_from(msg: pb.Quantized, shape: tuple[int, ...], check: BufferBytes) -> QuantPart:
    if not 1 <= msg.bits <= 8:
        raise PayloadError(f"quantization bits {msg.bits} out of range 1..8")
    if msg.granularity not in _GRANULARITY_BACK:
        raise PayloadError(f"unknown quantization granularity {msg.granularity}")
    granularity = _GRANULARITY_BACK[msg.granularity]
    count = math.prod(shape)
    groups = quant_groups(shape, granularity)
    codes, lows, steps = check.add(msg.codes), check.add(msg.lows), check.add(msg.steps)
    expect_length("quantized codes", codes, bitpack.packed_length(count, msg.bits))
    expect_length("quantization lows", lows, 4 * groups)
    expect_length("quantization steps", steps, 4 * groups)
    lows = from_bytes(lows, torch.float32)
    steps = from_bytes(steps, torch.float32)
    if not (bool(torch.isfinite(lows).all()) and bool(torch.isfinite(steps).all())):
        raise PayloadError("quantization ranges are not finite")
    codes = bitpack.unpack(from_bytes(codes, torch.uint8), msg.bits, count)
    return QuantPart(msg.bits, granularity, codes, lows, steps)


def extremes(part: RawPart | QuantPart) -> torch.Tensor:
    """Values that bound what the part decodes to: raw values, a quantized group's lowest and highest level."""
    if isinstance(part, RawPart):
        return part.data
    return torch.cat([part.lows, part.lows + part.steps * ((1 << part.bits) - 1)])


def values_from(msg, oneof: str, shape: tuple[int, ...], check: BufferBytes, what: str) -> RawPart | QuantPart:
    """The raw or quantized values of `shape` set in the message's `oneof`."""
    which = msg.WhichOneof(oneof)
    if which is None:
        raise PayloadError(f"payload has no {what}")
    if which.startswith("quantized"):
        return quant_from(getattr(msg, which), shape, check)
    return raw_from(getattr(msg, which), math.prod(shape), check)


def largest(part: RawPart | QuantPart) -> float:
    values = extremes(part)
    return float(values.double().abs().max()) if values.numel() else 0.0
