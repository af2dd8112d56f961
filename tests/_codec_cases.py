"""Codec cases shared by the codec test modules (not a test module itself)."""

from __future__ import annotations

import torch

from protocols import wire
from protocols.message import Encoded, Granularity, LowRankPart, QuantPart, SparsePart, SubspacePart
from swarm.compression import Cast, Codec, Quantize, TopK, TopKReuse
from swarm.compression.basis import LinkSubspace
from swarm.compression.lowrank import LowRank
from swarm.compression.subspace import Subspace

G = Granularity
CODECS = {
    "none": Cast(),
    "fp32": Cast(torch.float32),
    "fp16": Cast(torch.float16),
    "bf16": Cast(torch.bfloat16),
    "quant:1/sample": Quantize(1, G.SAMPLE),
    "quant:2/tensor": Quantize(2, G.TENSOR),
    "quant:3/channel": Quantize(3, G.CHANNEL),
    "quant:4/sample/stochastic": Quantize(4, G.SAMPLE, stochastic=True),
    "quant:5/tensor": Quantize(5, G.TENSOR),
    "quant:6/channel/stochastic": Quantize(6, G.CHANNEL, stochastic=True),
    "quant:7/sample": Quantize(7, G.SAMPLE),
    "quant:8/channel": Quantize(8, G.CHANNEL),
    "topk:0.1": TopK(0.1),
    "topk:0.3/fp16": TopK(0.3, Cast(torch.float16)),
    "topk:0.5/bf16": TopK(0.5, Cast(torch.bfloat16)),
    "topk:0.25/q4": TopK(0.25, Quantize(4, G.SAMPLE)),
    "topk:0.2/q8/stochastic": TopK(0.2, Quantize(8, G.SAMPLE, stochastic=True)),
    "topk:1.0": TopK(1.0),
    "lowrank:2": LowRank(2),
    "lowrank:3/q8": LowRank(3, Quantize(8, G.SAMPLE)),
    "lowrank:64/fp32": LowRank(64, Cast(torch.float32)),
    "subspace:2": Subspace(2),  # standalone messages: each carries its basis
    "subspace:3/q8": Subspace(3, Quantize(8, G.SAMPLE)),
    "subspace:64/fp32": Subspace(64, Cast(torch.float32)),
}

SHAPES = [
    ((0, 5), "contiguous"),
    ((3, 0), "contiguous"),
    ((0,), "contiguous"),
    ((), "contiguous"),
    ((1,), "contiguous"),
    ((1, 1), "contiguous"),
    ((7,), "contiguous"),
    ((4, 10), "contiguous"),
    ((2, 3, 4, 5), "contiguous"),
    ((4, 10), "transposed"),
    ((4, 10), "strided"),
    ((9,), "strided"),
    ((2, 3, 4, 5), "permuted"),
    ((2, 3, 4, 5), "strided"),
]


def shape_id(case):
    shape, layout = case
    return f"{'x'.join(map(str, shape)) or 'scalar'}-{layout}"


def through_wire(enc):
    return wire.decode(wire.encode(enc))


def codec_of(enc: Encoded) -> Codec:
    """A codec of the payload's own kind (a receiver decodes only its link codec's payloads):
    `none` for raw values, which takes them in any dtype; a TopK's ratio does not matter to decode;
    a low-rank or subspace payload's rank is the link's when it is below the matrix's dimensions."""
    body = enc.body
    if isinstance(body, LowRankPart):
        factors = body.left
        inner = (
            Quantize(factors.bits, factors.granularity) if isinstance(factors, QuantPart) else Cast(factors.data.dtype)
        )
        return LowRank(max(body.rank, 1), inner)
    if isinstance(body, SubspacePart):
        values = body.coefficients
        inner = Quantize(values.bits, values.granularity) if isinstance(values, QuantPart) else Cast(values.data.dtype)
        codec = Subspace(max(body.rank, 1), inner)
        return codec if body.basis_version == 0 else LinkSubspace(codec)  # a fresh end takes a first basis
    values = body.values if isinstance(body, SparsePart) else body
    inner = Quantize(values.bits, values.granularity) if isinstance(values, QuantPart) else Cast()
    if not isinstance(body, SparsePart):
        return inner
    return TopK(1.0, inner) if body.positions is not None else TopKReuse(inner)


def rows_of(shape):
    return shape[0] if len(shape) >= 2 else 1


def group_view(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """x as [groups, elements] for the given granularity (independent of the library)."""
    shape = tuple(x.shape)
    if granularity is G.TENSOR:
        return x.reshape(1, -1)
    if granularity is G.CHANNEL and len(shape) >= 3:
        return x.reshape(shape[0] * shape[1], -1)
    return x.reshape(rows_of(shape), -1)
