"""The wire format's validations, each reached by a hand-made message: every way a payload can be
malformed is refused with a one-line PayloadError (protocols.wire)."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch
from _util import make, parse_pb, seal
from test_wire import _generic_receive

from protocols import PROTOCOL_VERSION, DecodeLimits, Encoded, PayloadError, RawPart, wire
from protocols import compressed_tensor_pb2 as pb
from swarm.compression import parse

# ---- hand-made messages: every validation is reachable ------------------------------------------


def raw_msg(shape=(2, 3), dtype=pb.FLOAT32, data=None):
    n = math.prod(shape)
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=shape, dtype=dtype)
    m.raw.wire_dtype = pb.FLOAT32
    m.raw.data = data if data is not None else struct.pack(f"<{n}f", *range(n))
    return m


def quant_msg(shape=(2, 4), bits=4, granularity=pb.PER_SAMPLE):
    n = math.prod(shape)
    groups = shape[0]
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=shape, dtype=pb.FLOAT32)
    m.quantized.bits = bits
    m.quantized.granularity = granularity
    m.quantized.codes = bytes(-(-n * 4 // 8))
    m.quantized.lows = struct.pack(f"<{groups}f", *([0.0] * groups))
    m.quantized.steps = struct.pack(f"<{groups}f", *([1.0] * groups))
    return m


def sparse_msg(shape=(2, 8), k=2, positions=(0, 3, 8, 15)):
    total = math.prod(shape)
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=shape, dtype=pb.FLOAT32)
    m.sparse.kept_per_sample = k
    m.sparse.index_coding = pb.BITMAP
    bits = bytearray(-(-total // 8))
    for p in positions:
        bits[p // 8] |= 1 << (p % 8)
    m.sparse.indices = bytes(bits)
    m.sparse.raw_values.wire_dtype = pb.FLOAT32
    m.sparse.raw_values.data = struct.pack(f"<{len(positions)}f", *range(len(positions)))
    return m


def low_rank_msg(shape=(4, 3), rank=2):
    rows, cols = math.prod(shape[:-1]), shape[-1]
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=shape, dtype=pb.FLOAT32)
    m.low_rank.rank = rank
    m.low_rank.raw_left.wire_dtype = m.low_rank.raw_right.wire_dtype = pb.FLOAT16
    m.low_rank.raw_left.data = struct.pack(f"<{rank * rows}e", *([0.5] * (rank * rows)))
    m.low_rank.raw_right.data = struct.pack(f"<{rank * cols}e", *([0.25] * (rank * cols)))
    return m


def assert_rejected(m: pb.CompressedTensor, limits: DecodeLimits = wire.DEFAULT_LIMITS):
    """Sealed (correct length and checksum), yet refused by a semantic check."""
    payload = seal(m)
    with pytest.raises(PayloadError) as info:
        wire.decode(payload, limits)
    text = str(info.value)
    assert "checksum" not in text and "buffer bytes" not in text, text
    assert "\n" not in text
    return text


def test_handmade_messages_are_valid():
    for m in (raw_msg(), quant_msg(), sparse_msg(), low_rank_msg()):
        enc = wire.decode(seal(m))
        assert enc.shape == tuple(m.shape)
    enc = wire.decode(seal(sparse_msg()))
    assert enc.body.positions.tolist() == [0, 3, 8, 15]


@pytest.mark.parametrize("version", [v for v in (0, 1, 2, 3, 4, 5, 6, 999, 2**32 - 1) if v != PROTOCOL_VERSION])
def test_unknown_format_version(version):
    m = raw_msg()
    m.format_version = version
    assert_rejected(m)


@pytest.mark.parametrize("value", [0, 5, 6, 99, 2**31 - 1])
def test_unknown_dtype(value):
    m = raw_msg()
    m.dtype = value
    assert_rejected(m)
    m = raw_msg()
    m.raw.wire_dtype = value
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.raw_values.wire_dtype = value
    assert_rejected(m)


@pytest.mark.parametrize("bits", [0, 9, 16, 255, 2**32 - 1])
def test_bad_bits(bits):
    m = quant_msg()
    m.quantized.bits = bits
    assert_rejected(m)


@pytest.mark.parametrize("granularity", [0, 4, 77])
def test_unknown_granularity(granularity):
    m = quant_msg()
    m.quantized.granularity = granularity
    assert_rejected(m)


@pytest.mark.parametrize("which", ["lows", "steps"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_ranges(which, bad):
    m = quant_msg()
    setattr(m.quantized, which, struct.pack("<2f", 0.0, bad))
    assert_rejected(m)


def test_wrong_buffer_lengths():
    m = raw_msg(data=bytes(4 * 6 - 1))
    assert_rejected(m)
    m = raw_msg(data=bytes(4 * 6 + 4))
    assert_rejected(m)
    m = quant_msg()
    m.quantized.codes = m.quantized.codes + b"\0"
    assert_rejected(m)
    m = quant_msg()
    m.quantized.lows = m.quantized.lows[:4]
    assert_rejected(m)


@pytest.mark.parametrize("k", [9, 17, 1000, 2**40, 2**64 - 1])
def test_kept_per_sample_above_n(k):
    m = sparse_msg()
    m.sparse.kept_per_sample = k
    assert_rejected(m)


def test_sparse_validations():
    m = sparse_msg(positions=(0, 1, 2, 3))  # all four in the first sample
    assert_rejected(m)
    m = sparse_msg(positions=(0, 3, 8))  # three marked, four values expected
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.index_coding = pb.INDEX_CODING_UNSPECIFIED
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.index_coding = 9
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.index_coding = pb.REUSED  # reused-index payloads carry no indices
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.ClearField("raw_values")
    assert_rejected(m)
    m = sparse_msg()
    m.sparse.index_coding = pb.DELTA_VARINT  # bitmap bytes read as varints
    assert_rejected(m)
    m = sparse_msg(shape=(2, 7), positions=(0, 3, 7, 13))
    m.sparse.indices = bytes([m.sparse.indices[0], m.sparse.indices[1] | 0x80])  # bit 15 of 14
    assert_rejected(m)


def test_no_body():
    m = pb.CompressedTensor(format_version=PROTOCOL_VERSION, shape=(2,), dtype=pb.FLOAT32)
    assert_rejected(m)


@pytest.mark.parametrize("body", ["raw", "quant", "sparse", "low_rank"])
@pytest.mark.parametrize("shape", [(2**20, 2**20, 2**20), (2**62, 2), (2**63, 2**63), (2**64 - 1,), (65536, 65536)])
def test_oversize_shape_rejected_before_allocation(body, shape):
    """Tiny buffers, gigantic shape: refused on the limit (allocating would raise another error)."""
    m = {"raw": raw_msg, "quant": quant_msg, "sparse": sparse_msg, "low_rank": low_rank_msg}[body]()
    del m.shape[:]
    m.shape.extend(shape)
    text = assert_rejected(m)
    assert "limit" in text or "exceeds" in text, text


def test_max_elements_limit_is_exact():
    limits = DecodeLimits(max_elements=100)
    ok = parse("none").sender().send(make((10, 10))).payload
    assert wire.decode(ok, limits).shape == (10, 10)
    for spec in ("none", "quant:4", "topk:0.1"):
        payload = parse(spec).sender().send(make((101,))).payload
        with pytest.raises(PayloadError):
            wire.decode(payload, limits)


def test_max_rank_and_payload_size():
    payload = parse("none").sender().send(make((1,) * 9)).payload
    with pytest.raises(PayloadError):
        wire.decode(payload)
    assert wire.decode(payload, DecodeLimits(max_rank=9)).shape == (1,) * 9
    payload = parse("none").sender().send(make((100,))).payload
    with pytest.raises(PayloadError):
        wire.decode(payload, DecodeLimits(max_payload_bytes=len(payload) - 1))
    assert wire.decode(payload, DecodeLimits(max_payload_bytes=len(payload))).shape == (100,)


def test_integrity_checks():
    payload = parse("quant:4").sender().send(make((4, 8))).payload
    m = parse_pb(payload)
    m.buffer_length += 1
    with pytest.raises(PayloadError):
        wire.decode(m.SerializeToString())
    m = parse_pb(payload)
    m.checksum ^= 1
    with pytest.raises(PayloadError):
        wire.decode(m.SerializeToString())
    m = parse_pb(payload)
    m.quantized.lows = struct.pack("<4f", 9, 9, 9, 9)  # valid values, but not what was checksummed
    with pytest.raises(PayloadError):
        wire.decode(m.SerializeToString())
    assert zlib.crc32(payload[:-5]) == parse_pb(payload).checksum


def test_receiver_rejects_unrepresentable_empty_shapes():
    """Zero elements, but a dimension no tensor can have (>= 2**63): the receiver must answer
    PayloadError (wire.decode accepts these because only the element count is limited)."""
    failures = []
    for shape in [(2**64 - 1, 0), (2**63, 0), (0, 2**63), (3, 0, 2**63 + 5)]:
        for body in ("raw", "quant", "sparse", "low_rank"):
            m = {"raw": raw_msg, "quant": quant_msg, "sparse": sparse_msg, "low_rank": low_rank_msg}[body]()
            del m.shape[:]
            m.shape.extend(shape)
            if body == "low_rank":
                m.low_rank.rank = 0
                m.low_rank.raw_left.data = m.low_rank.raw_right.data = b""
            elif body == "raw":
                m.raw.data = b""
            elif body == "quant":
                m.quantized.codes = m.quantized.lows = m.quantized.steps = b""
            else:
                m.sparse.kept_per_sample = 0
                m.sparse.indices = b""
                m.sparse.raw_values.data = b""
            try:
                _generic_receive(seal(m), None)
            except PayloadError:
                continue
            except Exception as e:  # noqa: BLE001 - the point is which type escapes
                failures.append((shape, body, type(e).__name__))
            else:
                failures.append((shape, body, "accepted"))
    assert not failures, failures


def test_encode_rejects_unsupported_dtype():
    with pytest.raises((TypeError, KeyError, ValueError)):
        wire.encode(Encoded((3,), torch.int32, RawPart(torch.arange(3, dtype=torch.int32))))


def test_decoded_tensors_do_not_alias_payload():
    payload = parse("none").sender().send(make((4, 4))).payload
    keep = bytes(payload)
    inc = parse("none").receiver().receive(wire.decode(payload))
    inc.tensor.add_(1.0)  # consumers may modify what they receive in place
    assert payload == keep
    again = parse("none").receiver().receive(wire.decode(payload)).tensor
    assert torch.equal(again + 1.0, inc.tensor)
