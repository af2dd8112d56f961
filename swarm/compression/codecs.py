"""Codecs: a tensor to an `Encoded` (parts the wire packs) and back.

- `Cast`: values as they are (`none`) or cast to fp16 / bf16 / fp32.
- `Quantize`: k-bit min-max codes, per tensor, sample or channel.
- `TopK`: per-sample TopK; its values go through an inner `Cast` or `Quantize`.
- `TopKReuse`: values at the positions of the forward message on the same link (values only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.errors import PayloadError
from protocols.message import Encoded, Granularity, QuantPart, RawPart, SparsePart
from protocols.wire import rows_of
from swarm.compression.quantize import dequantize, quantize
from swarm.compression.topk import Selection, gather, scatter, top_positions

_FP16_MAX = 65504.0


class Codec:
    """Stateless math: encode returns in-memory parts, decode inverts them."""

    spec: str

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def sparse(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"


class DenseCodec(Codec):
    """A codec whose payload is one dense body (also usable for TopK values)."""

    def values(self, x: torch.Tensor) -> RawPart | QuantPart:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        return Encoded(tuple(x.shape), x.dtype, self.values(x))

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        if isinstance(enc.body, SparsePart):
            raise PayloadError("dense codec got a TopK payload")
        return decode_values(enc.body, enc.shape, enc.dtype, device)


# ---- value codecs (dense bodies; also the values of a TopK message) ----------------------------


@dataclass(frozen=True, repr=False)
class Cast(DenseCodec):
    """Values as they are (wire_dtype None) or cast to a narrower float."""

    wire_dtype: torch.dtype | None = None

    @property
    def spec(self) -> str:
        names = {None: "none", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
        return names[self.wire_dtype]

    def values(self, x: torch.Tensor) -> RawPart:
        x = x.detach().reshape(-1)
        if self.wire_dtype is None or x.dtype == self.wire_dtype:
            return RawPart(x)
        if self.wire_dtype == torch.float16:  # saturate instead of overflowing to inf
            wide = x if x.dtype in (torch.float32, torch.float64) else x.float()  # bf16 cannot hold 65504
            x = wide.clamp(-_FP16_MAX, _FP16_MAX)
        return RawPart(x.to(self.wire_dtype))


@dataclass(frozen=True, repr=False)
class Quantize(DenseCodec):
    bits: int
    granularity: Granularity = Granularity.SAMPLE
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"quantization bits must be 1..8, got {self.bits}")

    @property
    def spec(self) -> str:
        tail = "/stochastic" if self.stochastic else ""
        return f"quant:{self.bits}/{self.granularity.value}{tail}"

    def values(self, x: torch.Tensor) -> QuantPart:
        return quantize(x, self.bits, self.granularity, self.stochastic)


ValueCodec = Cast | Quantize


def decode_values(part: RawPart | QuantPart, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    if isinstance(part, QuantPart):
        return dequantize(part, shape, dtype, device)
    return part.data.to(device=device, dtype=dtype).reshape(shape)


# ---- sparse codecs ------------------------------------------------------------------------------


def _sparse_values(inner: ValueCodec, x: torch.Tensor, positions: torch.Tensor, kept: int) -> RawPart | QuantPart:
    rows = rows_of(tuple(x.shape))
    return inner.values(gather(x, positions).view(rows, kept))


def decode_sparse(enc: Encoded, reuse: Selection | None = None, device=None) -> torch.Tensor:
    """Decode a TopK body, with its own indices or with the forward message's (reuse)."""
    part = enc.body
    assert isinstance(part, SparsePart)
    if part.positions is None:
        if reuse is None:
            raise PayloadError("reused-index payload, but this link remembers no forward indices")
        rows = rows_of(enc.shape)
        if (
            part.index_digest != reuse.digest
            or part.kept_per_sample != reuse.kept_per_sample
            or reuse.positions.numel() != rows * part.kept_per_sample
            or (reuse.positions.numel() and int(reuse.positions[-1]) >= enc.numel)
        ):
            raise PayloadError("reused-index payload does not match the forward message's indices")
        positions = reuse.positions
    else:
        positions = part.positions
    rows = rows_of(enc.shape)
    values = decode_values(part.values, (rows, part.kept_per_sample), enc.dtype, device)
    return scatter(values.reshape(-1), positions, enc.shape, enc.dtype, device)


@dataclass(frozen=True, repr=False)
class TopK(Codec):
    """Keep ceil(ratio * n) largest-magnitude values of every sample."""

    ratio: float
    inner: ValueCodec = Cast()

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopK ratio must be in (0, 1], got {self.ratio}")

    @property
    def sparse(self) -> bool:
        return True

    @property
    def spec(self) -> str:
        return f"topk:{self.ratio:g}" + ("" if self.inner == Cast() else f"/{_inner_spec(self.inner)}")

    def encode_at(self, x: torch.Tensor, positions: torch.Tensor, kept: int) -> Encoded:
        """Encode the values of x at sorted flat positions (EF-mixed chooses its own)."""
        part = SparsePart(kept, positions, _sparse_values(self.inner, x, positions, kept))
        return Encoded(tuple(x.shape), x.dtype, part)

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        positions, kept = top_positions(x, self.ratio)
        return self.encode_at(x, positions, kept)

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        part = enc.body
        if not isinstance(part, SparsePart) or part.positions is None:
            raise PayloadError("TopK codec got a payload without indices")
        return decode_sparse(enc, None, device)


@dataclass(frozen=True, repr=False)
class TopKReuse(Codec):
    """Gradient values at the forward activation's positions: the payload carries no indices."""

    inner: ValueCodec = Cast()

    @property
    def sparse(self) -> bool:
        return True

    @property
    def spec(self) -> str:
        return "topk:reuse" + ("" if self.inner == Cast() else f"/{_inner_spec(self.inner)}")

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        if reuse is None:
            raise ValueError("topk:reuse needs the forward message's TopK selection on this link")
        if reuse.positions.numel() != rows_of(tuple(x.shape)) * reuse.kept_per_sample:
            raise ValueError(f"forward TopK selection does not fit a gradient of shape {tuple(x.shape)}")
        values = _sparse_values(self.inner, x, reuse.positions, reuse.kept_per_sample)
        return Encoded(tuple(x.shape), x.dtype, SparsePart(reuse.kept_per_sample, None, values, reuse.digest))

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        part = enc.body
        if not isinstance(part, SparsePart) or part.positions is not None:
            raise PayloadError("expected a reused-index TopK payload")
        return decode_sparse(enc, reuse, device)


def _inner_spec(inner: ValueCodec) -> str:
    if isinstance(inner, Quantize):
        return f"q{inner.bits}" + ("/stochastic" if inner.stochastic else "")
    return inner.spec


def selection_of(enc: Encoded) -> Selection | None:
    """The TopK selection a message used (after wire.encode or wire.decode filled the digest)."""
    part = enc.body
    if isinstance(part, SparsePart) and part.positions is not None:
        return Selection(part.positions, part.kept_per_sample, enc.index_digest)
    return None
