"""protocols.wire: every malformed payload raises PayloadError, and nothing else."""

from __future__ import annotations

import zlib

import pytest
import torch
from _codec_cases import codec_of
from _util import buffers_of, make, parse_pb
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import Encoded, PayloadError, checksum, wire
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
        "subspace:2",  # a link's first message: it carries the basis (version 1)
        "subspace:3/q8/every4",
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
    items.append(("subspace:2/fp32 standalone", parse("subspace:2/fp32").sender().send_stateless(x).payload, None))
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


def test_lists_longer_than_their_tensor_allows_are_refused_before_they_are_walked():
    """A payload's repeated fields are refused by their length, before a Python loop reads them:
    state versions (one per sample at most), a carried tensor's shape (at most 8 dimensions)."""
    from protocols import stage_pb2 as spb
    from protocols.message import RawPart, StateStamp
    from swarm.transport.hivemind.net.meta import ProtocolError, raw_to_tensor

    stamped = Encoded((4, 8), torch.float32, RawPart(torch.zeros(4, 8)), StateStamp(sample_versions=(1,) * 4))
    assert wire.decode(wire.encode(stamped)).stamp.sample_versions == (1,) * 4
    stamped.stamp = StateStamp(sample_versions=(1,) * 100_000)
    with pytest.raises(PayloadError, match="^100000 state versions for 4 samples$"):
        wire.decode(wire.encode(stamped))
    with pytest.raises(ProtocolError, match=r"^targets: a shape of 100000 dimensions \(at most 8\)$"):
        raw_to_tensor(spb.RawTensor(dtype="int64", shape=[1] * 100_000, data=bytes(8)), "targets")
