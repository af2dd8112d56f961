"""Codecs: a tensor to an `Encoded` (parts the wire packs) and back.

- `Cast`: values as they are (`none`) or cast to fp16 / bf16 / fp32.
- `Quantize`: k-bit min-max codes, per tensor, sample or channel.
- `TopK`: per-sample TopK; its values go through an inner `Cast` or `Quantize`.
- `TopKReuse`: values at the positions of the forward message on the same link (values only).
- `LowRank` (`swarm.compression.lowrank`): two rank-R factors of the tensor as a matrix.
- `Subspace` (`swarm.compression.subspace`): coefficients in a basis both ends of a link hold, a
  codec with link state of its own (`link_state`, `delivered`: `swarm.compression.basis`), as is
  a `/warm` low-rank sender (`swarm.compression.warm`: its start, on the sender only).

`decode` is each codec's one way back, for received payloads and for a sender's own error
feedback alike; it refuses, with a one-line `PayloadError`, a payload this codec does not produce
(a quant:4 payload on a topk:0.1 link), so nothing is decoded with a codec the link does not run.
Exact payloads (`EXACT`, what warmup and uncompressed evaluation send) are the receiver's to route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocols.errors import PayloadError
from protocols.message import Encoded, Granularity, LowRankPart, QuantPart, RawPart, SparsePart, SubspacePart
from protocols.wire import rows_of
from swarm.compression.quantize import dequantize, quantize
from swarm.compression.topk import Selection, gather, scatter, top_positions

_FP16_MAX = 65504.0
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


class Codec:
    """Stateless math: encode returns in-memory parts, decode inverts them."""

    spec: str
    link_state = None  # state kept per link, changed as messages are delivered (a subspace basis, a warm start)

    def delivered(self, enc: Encoded) -> Callable[[], None] | None:
        """The change that delivering `enc` makes to `link_state`, applied when the message is
        committed; None for codecs without link state."""
        return None

    @property
    def standalone(self) -> Codec:
        """This codec's messages that need no link state (evaluation sends them)."""
        return self

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        """The tensor `enc` stands for; PayloadError if this codec does not produce such payloads."""
        raise NotImplementedError

    @property
    def sparse(self) -> bool:
        return False

    def _refuse(self, enc: Encoded) -> PayloadError:
        return PayloadError(f"a {describe(enc)} payload on a {self.spec} link")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"


class DenseCodec(Codec):
    """A codec whose payload is one dense body (also usable for TopK values)."""

    def values(self, x: torch.Tensor) -> RawPart | QuantPart:
        raise NotImplementedError

    def holds(self, part: RawPart | QuantPart) -> bool:
        """Whether `part` is values of this codec (a dense body, or a TopK message's values)."""
        raise NotImplementedError

    def decode_values(self, part, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
        """Inverts `values`: a tensor of `shape` and `dtype` from a part this codec `holds`."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        return Encoded(tuple(x.shape), x.dtype, self.values(x))

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        if isinstance(enc.body, SparsePart) or not self.holds(enc.body):
            raise self._refuse(enc)
        return self.decode_values(enc.body, enc.shape, enc.dtype, device)


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

    def holds(self, part: RawPart | QuantPart) -> bool:
        # `none` sends values in whatever dtype they are in: error feedback's fp32 sums of a bf16 tensor too
        return isinstance(part, RawPart) and self.wire_dtype in (None, part.data.dtype)

    def decode_values(self, part: RawPart, shape, dtype, device=None) -> torch.Tensor:
        return part.data.to(device=device, dtype=dtype).reshape(shape)


EXACT = Cast()  # what warmup and uncompressed evaluation send on any link


def is_exact(enc: Encoded) -> bool:
    """Whether `enc` is an exact payload: raw values in the tensor's own dtype (`EXACT`'s)."""
    return isinstance(enc.body, RawPart) and enc.body.data.dtype == enc.dtype


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

    def holds(self, part: RawPart | QuantPart) -> bool:
        return isinstance(part, QuantPart) and (part.bits, part.granularity) == (self.bits, self.granularity)

    def decode_values(self, part: QuantPart, shape, dtype, device=None) -> torch.Tensor:
        return dequantize(part, shape, dtype, device)


ValueCodec = Cast | Quantize


def describe(enc: Encoded) -> str:
    """A payload's kind in the spec grammar's words, for refusals: fp16, quant:4/sample, topk/q8, lowrank:8/fp16, subspace:8/q8."""
    body = enc.body
    if isinstance(body, SparsePart):
        return f"{'topk' if body.positions is not None else 'topk:reuse'}/{_values_kind(body.values)}"
    if isinstance(body, LowRankPart):
        return f"lowrank:{body.rank}/{_values_kind(body.left)}"
    if isinstance(body, SubspacePart):
        return f"subspace:{body.rank}/{_values_kind(body.coefficients)}"
    if isinstance(body, QuantPart):
        return f"quant:{body.bits}/{body.granularity.value}"
    return _dtype_name(body.data.dtype)


def _values_kind(values: RawPart | QuantPart) -> str:
    return f"q{values.bits}" if isinstance(values, QuantPart) else _dtype_name(values.data.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# ---- sparse codecs ------------------------------------------------------------------------------


def _sparse_values(inner: ValueCodec, x: torch.Tensor, positions: torch.Tensor, kept: int) -> RawPart | QuantPart:
    rows = rows_of(tuple(x.shape))
    return inner.values(gather(x, positions).view(rows, kept))


class _Sparse(Codec):
    """TopK bodies: values through the `inner` codec at positions the payload carries (`TopK`) or
    at the forward message's (`TopKReuse`, `reused`)."""

    reused = False

    @property
    def sparse(self) -> bool:
        return True

    @property
    def _values_spec(self) -> str:
        return "" if self.inner == Cast() else f"/{inner_spec(self.inner)}"

    def _positions(self, enc: Encoded, reuse: Selection | None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, enc: Encoded, device=None, reuse: Selection | None = None) -> torch.Tensor:
        part = enc.body
        if not (
            isinstance(part, SparsePart) and (part.positions is None) == self.reused and self.inner.holds(part.values)
        ):
            raise self._refuse(enc)
        positions = self._positions(enc, reuse)
        shape = (rows_of(enc.shape), part.kept_per_sample)
        values = self.inner.decode_values(part.values, shape, enc.dtype, device)
        return scatter(values.reshape(-1), positions, enc.shape, enc.dtype, device)


@dataclass(frozen=True, repr=False)
class TopK(_Sparse):
    """Keep ceil(ratio * n) largest-magnitude values of every sample."""

    ratio: float
    inner: ValueCodec = Cast()

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopK ratio must be in (0, 1], got {self.ratio}")

    @property
    def spec(self) -> str:
        return f"topk:{self.ratio:g}{self._values_spec}"

    def encode_at(self, x: torch.Tensor, positions: torch.Tensor, kept: int) -> Encoded:
        """Encode the values of x at sorted flat positions (EF-mixed chooses its own)."""
        part = SparsePart(kept, positions, _sparse_values(self.inner, x, positions, kept))
        return Encoded(tuple(x.shape), x.dtype, part)

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        positions, kept = top_positions(x, self.ratio)
        return self.encode_at(x, positions, kept)

    def _positions(self, enc: Encoded, reuse: Selection | None) -> torch.Tensor:
        return enc.body.positions  # protocols.wire checked them against the shape


@dataclass(frozen=True, repr=False)
class TopKReuse(_Sparse):
    """Gradient values at the forward activation's positions: the payload carries no indices."""

    inner: ValueCodec = Cast()
    reused = True

    @property
    def spec(self) -> str:
        return f"topk:reuse{self._values_spec}"

    def encode(self, x: torch.Tensor, reuse: Selection | None = None) -> Encoded:
        if reuse is None:
            raise ValueError("topk:reuse needs the forward message's TopK selection on this link")
        if reuse.positions.numel() != rows_of(tuple(x.shape)) * reuse.kept_per_sample:
            raise ValueError(f"forward TopK selection does not fit a gradient of shape {tuple(x.shape)}")
        values = _sparse_values(self.inner, x, reuse.positions, reuse.kept_per_sample)
        return Encoded(tuple(x.shape), x.dtype, SparsePart(reuse.kept_per_sample, None, values, reuse.digest))

    def _positions(self, enc: Encoded, reuse: Selection | None) -> torch.Tensor:
        """The forward message's positions, if the payload names them (digest) and they fit its shape."""
        if reuse is None:
            raise PayloadError("reused-index payload, but this link remembers no forward indices")
        part = enc.body
        if (
            part.index_digest != reuse.digest
            or part.kept_per_sample != reuse.kept_per_sample
            or reuse.positions.numel() != rows_of(enc.shape) * part.kept_per_sample
            or (reuse.positions.numel() and int(reuse.positions[-1]) >= enc.numel)
        ):
            raise PayloadError("reused-index payload does not match the forward message's indices")
        return reuse.positions


def inner_spec(inner: ValueCodec) -> str:
    if isinstance(inner, Quantize):
        return f"q{inner.bits}" + ("/stochastic" if inner.stochastic else "")
    return inner.spec


def selection_of(enc: Encoded) -> Selection | None:
    """The TopK selection a message used (after wire.encode or wire.decode filled the digest)."""
    part = enc.body
    if isinstance(part, SparsePart) and part.positions is not None:
        return Selection(part.positions, part.kept_per_sample, enc.index_digest)
    return None
