"""protocols.wire with subspace bodies: malformed coefficients and bases are refused in one line."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from _util import seal
from test_wire_messages import assert_rejected

from protocols import PROTOCOL_VERSION, PayloadError, SubspacePart, wire
from protocols import compressed_tensor_pb2 as pb
from swarm.compression import parse
from swarm.compression.basis import LinkSubspace
from swarm.compression.subspace import Subspace


def subspace_msg(shape=(4, 3), rank=2, version=1, basis=True):
    """Coefficients 0.5 in a basis of 0.25 entries (fp16), version 1 by default: a refresh."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=shape, dtype=pb.FLOAT32)
    m.subspace.rank, m.subspace.basis_version = rank, version
    m.subspace.raw_coefficients.wire_dtype = pb.FLOAT16
    m.subspace.raw_coefficients.data = struct.pack(f"<{rank * rows}e", *([0.5] * (rank * rows)))
    if basis:
        m.subspace.raw_basis.wire_dtype = pb.FLOAT16
        m.subspace.raw_basis.data = struct.pack(f"<{rank * cols}e", *([0.25] * (rank * cols)))
    return m


def test_handmade_refresh_decodes_to_coefficients_times_basis():
    enc = wire.decode(seal(subspace_msg(shape=(2, 2, 3))))
    assert isinstance(enc.body, SubspacePart) and (enc.body.rank, enc.body.basis_version) == (2, 1)
    out = LinkSubspace(Subspace(2)).decode(enc)
    assert out.shape == (2, 2, 3) and torch.equal(out, torch.full((2, 2, 3), 2 * 0.5 * 0.25))


def test_a_message_without_a_basis_parses_and_names_its_version():
    enc = wire.decode(seal(subspace_msg(version=7, basis=False)))
    assert (enc.body.basis, enc.body.basis_version) == (None, 7)


@pytest.mark.parametrize("rank", [4, 1000, 2**64 - 1])
def test_rank_above_the_columns(rank):
    m = subspace_msg(shape=(4, 3), basis=False)
    m.subspace.rank = rank  # a basis of 3-long rows has at most 3
    assert f"rank {rank} for a 4 x 3 matrix" in assert_rejected(m)


def test_a_carried_basis_has_rank_at_most_the_rows():
    """A basis found from a 2-row tensor has rank <= 2; a held one may serve 2 rows at rank 3."""
    assert "rank 3 for a 2 x 4 matrix" in assert_rejected(subspace_msg(shape=(2, 4), rank=3))
    assert wire.decode(seal(subspace_msg(shape=(2, 4), rank=3, basis=False))).body.rank == 3


@pytest.mark.parametrize("side", ["raw_coefficients", "raw_basis"])
@pytest.mark.parametrize("change", [-2, 2, -1])
def test_lengths_must_match_the_shape(side, change):
    m = subspace_msg()
    part = getattr(m.subspace, side)
    part.data = part.data[:change] if change < 0 else part.data + bytes(change)
    assert "expected" in assert_rejected(m)


def test_missing_coefficients_and_a_standalone_message_without_its_basis():
    m = subspace_msg()
    m.subspace.ClearField("raw_coefficients")
    assert "subspace coefficients" in assert_rejected(m)
    assert "carries no basis" in assert_rejected(subspace_msg(version=0, basis=False))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("side", ["raw_coefficients", "raw_basis"])
def test_non_finite_values(side, bad):
    m = subspace_msg()
    part = getattr(m.subspace, side)
    part.data = struct.pack("<e", bad) + part.data[2:]
    assert "not finite" in assert_rejected(m)


def test_a_basis_entry_outside_unit_range_and_overflowing_coefficients():
    m = subspace_msg()
    m.subspace.raw_basis.data = struct.pack("<e", 1.5) + m.subspace.raw_basis.data[2:]
    assert "outside" in assert_rejected(m)
    m = subspace_msg(basis=False)
    m.subspace.raw_coefficients.wire_dtype = pb.FLOAT32
    m.subspace.raw_coefficients.data = struct.pack("<8f", *([3e38] * 8))
    assert "overflows" in assert_rejected(m)


def test_a_codec_refuses_a_well_formed_payload_of_another_format():
    enc = wire.decode(seal(subspace_msg()))
    for codec in (Subspace(2, parse("quant:8").codec), parse("lowrank:2").codec, parse("fp16").codec):
        with pytest.raises(PayloadError, match="subspace:2/fp16 payload on a"):
            codec.decode(enc)
    m = subspace_msg()  # a quantized basis: no subspace codec sends one
    payload = parse("quant:8").sender().send(torch.rand(2, 3) / 2).payload
    q = pb.CompressedTensor()
    q.ParseFromString(payload)
    m.subspace.quantized_basis.CopyFrom(q.quantized)
    with pytest.raises(PayloadError, match="payload on a subspace:2 link"):
        LinkSubspace(Subspace(2)).decode(wire.decode(seal(m)))


@pytest.mark.parametrize("spec", ["subspace:2", "subspace:3/q8", "subspace:2/fp32"])
def test_payloads_from_the_codec_are_canonical_and_counted(spec):
    x = torch.randn(3, 7, 5)
    sender = parse(spec).sender()
    first = sender.send(x)
    first.commit()
    for payload, basis in ((first.payload, True), (sender.send(x).payload, False)):
        m = pb.CompressedTensor()
        m.ParseFromString(payload)
        assert m.SerializeToString() == payload
        assert (m.subspace.WhichOneof("basis") is not None) == basis
        assert wire.encode(wire.decode(payload)) == payload
