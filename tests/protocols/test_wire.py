"""protocols.wire: every malformed payload raises PayloadError, and nothing else."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch
from _codec_cases import codec_of
from _util import buffers_of, make, parse_pb, seal
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import PROTOCOL_VERSION, DecodeLimits, Encoded, PayloadError, RawPart, checksum, wire
from protocols import compressed_tensor_pb2 as pb
from swarm.compression import Receiver, parse

# ---- a corpus of real payloads, one or more per codec type ------------------------------------


def _corpus():
    torch.manual_seed(1234)
    items = []  # (name, payload, reuse selection or None)
    x = make((3, 8))
    for spec in [
        "none",
        "fp32",
        "fp16",
        "bf16",
        "quant:1",
        "quant:3/tensor",
        "quant:4/channel",
        "quant:8",
        "quant:5/stochastic",
        "topk:0.5",
        "topk:0.1/fp16",
        "topk:0.25/q4",
        "topk:1.0/bf16",
        "topk:0.3/q8",
        "lowrank:2",
        "lowrank:3/q8",
        "lowrank:8/bf16",
    ]:
        items.append((spec, parse(spec).sender().send(x).payload, None))
    items.append(("quant:6/channel 4-D", parse("quant:6/channel").sender().send(make((2, 3, 2, 2))).payload, None))
    items.append(("none fp64", parse("none").sender().send(make((5,), torch.float64)).payload, None))
    items.append(("none fp16", parse("none").sender().send(make((2, 5), torch.float16)).payload, None))
    # TopK with varint-coded indices (sparse enough that varints beat the bitmap)
    big = make((2, 200))
    items.append(("topk:0.02 varint", parse("topk:0.02/fp16").sender().send(big).payload, None))
    # reused indices
    fwd = parse("topk:0.25").sender().send(x)
    items.append(
        ("topk:reuse", parse("topk:reuse/fp16").sender().send(make((3, 8)), reuse=fwd.selection).payload, fwd.selection)
    )
    items.append(
        (
            "topk:reuse/q4",
            parse("topk:reuse/q4").sender().send(make((3, 8)), reuse=fwd.selection).payload,
            fwd.selection,
        )
    )
    # stamped (mirrored state)
    s = parse("topk:0.25+ef21").sender()
    s.send(x).commit()
    items.append(("topk+ef21 stamped", s.send(x).payload, None))
    lr = parse("lowrank:2+ef21").sender()  # the stamp (field 7) goes before a low-rank body (field 8)
    lr.send(x).commit()
    items.append(("lowrank+ef21 stamped", lr.send(x).payload, None))
    a = parse("quant:4+aqsgd/q4").sender()
    a.send(x, sample_ids=[10, 11, 12], warmup=True).commit()
    items.append(("quant+aqsgd stamped", a.send(x, sample_ids=[10, 11, 12]).payload, None))
    items.append(("warmup stamped", a.send(x, sample_ids=[13, 14, 15], warmup=True).payload, None))
    return items


CORPUS = _corpus()
CORPUS_IDS = [name for name, _, _ in CORPUS]


def _generic_receive(payload: bytes, reuse):
    """Decode any payload into a tensor, as a plain receiver on a link of the payload's codec would."""
    enc = wire.decode(payload)
    return Receiver(codec_of(enc)).receive(enc, reuse=reuse).tensor


def _check_corrupted(payload: bytes, original: pb.CompressedTensor, reuse) -> bool:
    """Decode a damaged payload: the checksum covers every byte, so it must be rejected.

    Returns True when rejected."""
    try:
        enc = wire.decode(payload)
    except PayloadError:
        return True
    # Accepted only if the damage left a payload with the same meaning (never seen so far),
    # and what was accepted must still decode to a tensor of its declared shape.
    msg = parse_pb(payload)
    assert b"".join(buffers_of(msg)) == b"".join(buffers_of(original)), "corrupted buffers were accepted"
    assert msg == original, "a corrupted header was accepted"
    try:
        t = _generic_receive(payload, reuse)
    except PayloadError:
        return False
    assert tuple(t.shape) == tuple(enc.shape)
    return False


def test_corpus_decodes():
    """Every payload decodes to a tensor of its declared shape and dtype, and what it decodes to
    encodes back to the same bytes (nothing is lost or reinterpreted on the way)."""
    for name, payload, reuse in CORPUS:
        enc = wire.decode(payload)
        assert wire.encode(enc) == payload, name
        t = _generic_receive(payload, reuse)
        assert (tuple(t.shape), t.dtype) == (enc.shape, enc.dtype), name


def test_corpus_is_canonical_protobuf():
    """The hand-written buffer fields (protocols.fields) give what protobuf's own serializer writes:
    any implementation re-serializes a payload to the same bytes, checksum field last."""
    for name, payload, _ in CORPUS:
        assert parse_pb(payload).SerializeToString() == payload, name


def test_fast_checksum_is_zlibs_crc32():
    data = bytes(range(256)) * 4099
    for piece in (b"", data[:1], data[:4096], data, memoryview(data)[7:]):
        assert checksum.crc32(piece) == zlib.crc32(piece)
    assert checksum.crc32(data[1000:], checksum.crc32(data[:1000])) == zlib.crc32(data)


# ---- truncation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("idx", range(len(CORPUS)), ids=CORPUS_IDS)
def test_every_truncation_rejected(idx):
    name, payload, _ = CORPUS[idx]
    for cut in range(len(payload)):
        with pytest.raises(PayloadError):
            wire.decode(payload[:cut])


def test_truncated_empty_tensor_with_state_stamp_rejected():
    """A mirrored message for an empty tensor: dropping its trailing state stamp must not go unnoticed."""
    sender = parse("topk:0.1+ef21").sender()
    for shape in [(3, 0), (0, 5)]:
        payload = sender.send(torch.zeros(shape)).payload
        assert wire.decode(payload).stamp is not None
        for cut in range(len(payload)):
            try:
                enc = wire.decode(payload[:cut])
            except PayloadError:
                continue
            pytest.fail(f"prefix of {cut}/{len(payload)} bytes of a {shape} payload decoded (stamp={enc.stamp})")


# ---- single-byte corruption ---------------------------------------------------------------------


@pytest.mark.parametrize("idx", range(len(CORPUS)), ids=CORPUS_IDS)
def test_every_single_byte_corruption(idx):
    name, payload, reuse = CORPUS[idx]
    original = parse_pb(payload)
    rejected = 0
    trials = 0
    for i in range(len(payload)):
        for new in {payload[i] ^ 0x01, payload[i] ^ 0x80, payload[i] ^ 0xFF, 0x00, 0x7F}:
            if new == payload[i]:
                continue
            damaged = payload[:i] + bytes([new]) + payload[i + 1 :]
            trials += 1
            rejected += _check_corrupted(damaged, original, reuse)
    # The checksum covers every byte: every corruption must be caught.
    assert rejected == trials, (rejected, trials)


@settings(max_examples=200)
@given(st.data())
def test_random_corruption(data):
    name, payload, reuse = data.draw(st.sampled_from(CORPUS))
    original = parse_pb(payload)
    damaged = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(damaged) - 1))
        damaged[i] = data.draw(st.integers(0, 255))
    _check_corrupted(bytes(damaged), original, reuse)


@settings(max_examples=200)
@given(st.data())
def test_random_splices(data):
    """Insertions, deletions and duplicated chunks; never an exception other than PayloadError."""
    name, payload, reuse = data.draw(st.sampled_from(CORPUS))
    i = data.draw(st.integers(0, len(payload)))
    j = data.draw(st.integers(i, len(payload)))
    op = data.draw(st.sampled_from(["delete", "insert", "duplicate"]))
    if op == "delete":
        damaged = payload[:i] + payload[j:]
    elif op == "insert":
        damaged = payload[:i] + data.draw(st.binary(min_size=1, max_size=16)) + payload[i:]
    else:
        damaged = payload[:j] + payload[i:j] + payload[j:]
    if damaged == payload:
        return
    try:
        enc = wire.decode(damaged)
    except PayloadError:
        return
    assert isinstance(enc, Encoded)
    try:
        t = _generic_receive(damaged, reuse)
    except PayloadError:
        return
    assert tuple(t.shape) == tuple(enc.shape)


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_random_bytes_rejected(raw):
    with pytest.raises(PayloadError):
        wire.decode(raw)


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=64), st.sampled_from(CORPUS))
def test_random_bytes_with_valid_prefix_rejected(tail, item):
    _, payload, _ = item
    with pytest.raises(PayloadError):
        wire.decode(payload[: len(payload) // 2] + tail)


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
