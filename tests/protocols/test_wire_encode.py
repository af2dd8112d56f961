"""wire.encode writes what protobuf itself writes: a reference encoder that sets every field on the
message and serializes it, against the hand-written buffer fields, on edge cases the corpus in
test_wire.py does not hold."""

from __future__ import annotations

import torch
from _util import seal

from protocols import PROTOCOL_VERSION, Encoded, RawPart, bitpack, indices, wire
from protocols import compressed_tensor_pb2 as pb
from protocols.message import Granularity, QuantPart, SparsePart, StateStamp


def _protobuf_encode(enc: Encoded) -> bytes:
    """The payload as protobuf itself builds it (every field set on the message, then serialized):
    the reference `wire.encode`'s hand-written buffer fields must match."""
    dtypes = {
        torch.float32: pb.FLOAT32,
        torch.float16: pb.FLOAT16,
        torch.bfloat16: pb.BFLOAT16,
        torch.float64: pb.FLOAT64,
    }

    def data(t: torch.Tensor) -> bytes:
        return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()

    def fill_raw(msg, part: RawPart):
        msg.wire_dtype, msg.data = dtypes[part.data.dtype], data(part.data)

    def fill_quant(msg, part: QuantPart):
        msg.bits, msg.granularity = (
            part.bits,
            {Granularity.TENSOR: pb.PER_TENSOR, Granularity.SAMPLE: pb.PER_SAMPLE, Granularity.CHANNEL: pb.PER_CHANNEL}[
                part.granularity
            ],
        )
        msg.codes, msg.lows, msg.steps = (
            data(bitpack.pack(part.codes, part.bits)),
            data(part.lows.float()),
            data(part.steps.float()),
        )

    msg = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=enc.shape, dtype=dtypes[enc.dtype])
    body = enc.body
    if isinstance(body, RawPart):
        fill_raw(msg.raw, body)
    elif isinstance(body, QuantPart):
        fill_quant(msg.quantized, body)
    else:
        if body.positions is None:
            msg.sparse.index_coding, msg.sparse.index_digest = pb.REUSED, body.index_digest
        else:
            coding, positions = indices.encode_indices(body.positions, enc.numel)
            msg.sparse.index_coding, msg.sparse.indices = (
                {"bitmap": pb.BITMAP, "varint": pb.DELTA_VARINT}[coding],
                data(positions),
            )
        msg.sparse.kept_per_sample = body.kept_per_sample
        (
            fill_quant(msg.sparse.quantized_values, body.values)
            if isinstance(body.values, QuantPart)
            else fill_raw(msg.sparse.raw_values, body.values)
        )
    if enc.stamp is not None:
        msg.state.version, msg.state.warmup = enc.stamp.version, enc.stamp.warmup
        msg.state.sample_versions.extend(enc.stamp.sample_versions)
    return seal(msg)


def _edge_encodings():
    torch.manual_seed(7)
    tensors = [
        torch.randn(6),
        torch.empty(0),
        torch.randn(5).bfloat16(),
        torch.randn(5).half(),
        torch.randn(5).double(),
        torch.randn(3, 4).t(),
        torch.randn(1).expand(4),
        torch.randn(4, requires_grad=True),
        torch.randn(10)[3:7],
        torch.randn(4, 3).bfloat16().t(),
        torch.tensor(1.5),
    ]

    def quant(n: int, bits: int) -> QuantPart:
        return QuantPart(
            bits,
            Granularity.TENSOR,
            torch.randint(0, 2**bits, (n,), dtype=torch.uint8),
            torch.randn(1 if n else 0),
            torch.rand(1 if n else 0),
        )

    for stamp in (None, StateStamp(), StateStamp(3, (1, 2), True), StateStamp(0, (0,), False)):
        for t in tensors:
            yield Encoded(tuple(t.shape), t.dtype, RawPart(t), stamp)
        for n, bits in ((0, 4), (1, 1), (7, 3), (64, 8)):
            yield Encoded((n,), torch.float32, quant(n, bits), stamp)
        for positions in (None, torch.tensor([], dtype=torch.int64), torch.tensor([0, 5, 9]), torch.arange(0, 100, 37)):
            for digest in (0, 0xFFFFFFFF):
                for values in (RawPart(torch.randn(3)), RawPart(torch.empty(0)), quant(3, 4), quant(0, 2)):
                    yield Encoded(
                        (1, 100),
                        torch.float32,
                        SparsePart(0 if positions is not None and not len(positions) else 3, positions, values, digest),
                        stamp,
                    )


def test_encode_writes_what_protobuf_writes_for_edge_cases():
    """Empty, scalar, strided, expanded, bf16 and grad-carrying tensors; default and set stamps;
    empty quantized and sparse parts, reused indices with a zero digest: the same bytes either way."""
    count = 0
    for enc in _edge_encodings():
        assert wire.encode(enc) == _protobuf_encode(enc), enc
        count += 1
    assert count == 4 * (11 + 4 + 4 * 2 * 4)
