"""protocols.wire with low-rank bodies: malformed factors are refused in one line before use."""

from __future__ import annotations

import struct

import pytest
import torch
from _util import seal
from test_wire_messages import assert_rejected, low_rank_msg

from protocols import PayloadError, wire
from protocols import compressed_tensor_pb2 as pb
from swarm.compression import Quantize, parse
from swarm.compression.lowrank import LowRank


def test_handmade_low_rank_decodes_to_the_product_of_its_factors():
    enc = wire.decode(seal(low_rank_msg(shape=(2, 2, 3), rank=2)))
    assert (enc.body.rank, enc.shape) == (2, (2, 2, 3))
    out = LowRank(2).decode(enc)
    assert out.shape == (2, 2, 3) and torch.equal(out, torch.full((2, 2, 3), 2 * 0.5 * 0.25))


@pytest.mark.parametrize("rank", [4, 1000, 2**40, 2**64 - 1])
def test_rank_above_the_matrix_dimensions(rank):
    m = low_rank_msg(shape=(4, 3), rank=2)
    m.low_rank.rank = rank  # a 4 x 3 matrix has rank at most 3
    assert f"rank {rank} for a 4 x 3 matrix" in assert_rejected(m)


def test_rank_that_does_not_match_the_factors():
    m = low_rank_msg(shape=(4, 3), rank=2)
    m.low_rank.rank = 3
    assert "expected" in assert_rejected(m)


@pytest.mark.parametrize("side", ["raw_left", "raw_right"])
@pytest.mark.parametrize("change", [-2, 2, -1])
def test_factor_lengths_must_match_the_shape(side, change):
    m = low_rank_msg()
    factor = getattr(m.low_rank, side)
    factor.data = factor.data[:change] if change < 0 else factor.data + bytes(change)
    text = assert_rejected(m)
    assert "expected" in text, text


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_missing_factor(side):
    m = low_rank_msg()
    m.low_rank.ClearField(f"raw_{side}")
    assert f"low-rank {side} factor" in assert_rejected(m)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("side", ["raw_left", "raw_right"])
def test_non_finite_factors(side, bad):
    m = low_rank_msg()
    factor = getattr(m.low_rank, side)
    factor.data = struct.pack("<e", bad) + factor.data[2:]
    assert "not finite" in assert_rejected(m)


def test_a_product_that_overflows_float32_is_refused():
    m = low_rank_msg(shape=(4, 3), rank=2)
    for factor, n in ((m.low_rank.raw_left, 8), (m.low_rank.raw_right, 6)):
        factor.wire_dtype = pb.FLOAT32
        factor.data = struct.pack(f"<{n}f", *([1e20] * n))
    assert "overflows" in assert_rejected(m)
    for factor, n in ((m.low_rank.raw_left, 8), (m.low_rank.raw_right, 6)):
        factor.data = struct.pack(f"<{n}f", *([1e15] * n))  # 2e30: large, but float32 holds it
    assert wire.decode(seal(m)).body.rank == 2


def test_quantized_factors_are_checked_like_quantized_values():
    x = torch.randn(6, 5)
    payload = parse("lowrank:2/q8").sender().send(x).payload
    m = pb.CompressedTensor()
    m.ParseFromString(payload)
    m.low_rank.quantized_right.lows = m.low_rank.quantized_right.lows[:4]  # one range for two components
    assert "lows" in assert_rejected(m)
    m.ParseFromString(payload)
    m.low_rank.quantized_left.bits = 9
    assert "bits" in assert_rejected(m)
    m.ParseFromString(payload)
    m.low_rank.quantized_left.steps = struct.pack("<2f", 1.0, float("inf"))
    assert "not finite" in assert_rejected(m)


def test_a_codec_refuses_a_well_formed_payload_of_another_rank_or_format():
    """wire.decode takes any rank up to the matrix's; the link's codec takes only its own."""
    enc = wire.decode(seal(low_rank_msg(shape=(4, 3), rank=1)))
    with pytest.raises(PayloadError, match="^a lowrank:1/fp16 payload on a lowrank:2 link$"):
        LowRank(2).decode(enc)
    assert LowRank(1).decode(enc).shape == (4, 3)
    for codec in (LowRank(2, Quantize(8)), parse("fp16").codec, parse("quant:8").codec, parse("topk:0.5").codec):
        with pytest.raises(PayloadError):
            codec.decode(wire.decode(seal(low_rank_msg())))


def test_empty_matrix_with_huge_rows_allocates_nothing():
    """Rank 0 of a matrix with no columns: the rows' product is far beyond any limit, but nothing
    of that size is allocated (each dimension is within the limit, the element count is 0)."""
    m = low_rank_msg(shape=(2**29, 2**29, 0), rank=0)
    m.low_rank.raw_left.data = m.low_rank.raw_right.data = b""
    out = LowRank(4).decode(wire.decode(seal(m)))
    assert out.shape == (2**29, 2**29, 0)


def test_payload_from_the_codec_is_canonical_and_counted():
    x = torch.randn(3, 7, 5)
    payload = parse("lowrank:2").sender().send(x).payload
    m = pb.CompressedTensor()
    m.ParseFromString(payload)
    assert m.SerializeToString() == payload
    assert len(m.low_rank.raw_left.data) == 2 * 2 * 21 and len(m.low_rank.raw_right.data) == 2 * 2 * 5
    assert m.buffer_length == 2 * 2 * (21 + 5)
