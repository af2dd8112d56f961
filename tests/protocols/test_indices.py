"""protocols.indices: bitmap and gap-varint coding of sorted TopK positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocols import PayloadError, indices


def positions_of(values) -> torch.Tensor:
    return torch.tensor(sorted(set(values)), dtype=torch.long)


def leb128_length(pos: torch.Tensor) -> int:
    """Bytes of the LEB128 gap coding, computed independently of the library."""
    prev, n = -1, 0
    for p in pos.tolist():
        gap = p - prev - 1
        n += max(1, -(-gap.bit_length() // 7))
        prev = p
    return n


def reference_leb128(pos: torch.Tensor) -> bytes:
    out, prev = bytearray(), -1
    for p in pos.tolist():
        gap = p - prev - 1
        prev = p
        while True:
            byte = gap & 0x7F
            gap >>= 7
            out.append(byte | (0x80 if gap else 0))
            if not gap:
                break
    return bytes(out)


@st.composite
def position_sets(draw, max_total=2000):
    total = draw(st.integers(1, max_total))
    chosen = draw(st.sets(st.integers(0, total - 1), max_size=min(total, 300)))
    return positions_of(chosen), total


@given(position_sets())
def test_bitmap_roundtrip(case):
    pos, total = case
    data = indices.encode_bitmap(pos, total)
    assert data.dtype == torch.uint8
    assert data.numel() == indices.bitmap_length(total)
    assert torch.equal(indices.decode_bitmap(data, total), pos)


@given(position_sets())
def test_varint_roundtrip_and_length(case):
    pos, total = case
    data = indices.encode_varint(pos)
    assert data.dtype == torch.uint8
    assert data.numel() == leb128_length(pos)
    assert torch.equal(indices.decode_varint(data, pos.numel(), total), pos)


@given(position_sets())
def test_varint_bytes_are_standard_leb128(case):
    pos, _ = case
    assert bytes(indices.encode_varint(pos).tolist()) == reference_leb128(pos)


@given(position_sets())
def test_both_codings_decode_to_same_positions(case):
    pos, total = case
    a = indices.decode_bitmap(indices.encode_bitmap(pos, total), total)
    b = indices.decode_varint(indices.encode_varint(pos), pos.numel(), total)
    assert torch.equal(a, b)


def test_bitmap_length():
    for total in range(0, 100):
        assert indices.bitmap_length(total) == -(-total // 8)


def test_varint_length_matches_leb128():
    """The varint stream has one LEB128 number per gap (gap = difference - 1, first = position)."""
    pos = positions_of([0, 1, 129, 130, 130 + 128 + 1, 20000, 20000 + 2**21 + 1])
    gaps = [0, 0, 127, 0, 128, 20000 - 259 - 1, 2**21]
    expect = sum(max(1, -(-g.bit_length() // 7)) for g in gaps)
    assert leb128_length(pos) == expect
    assert indices.encode_varint(pos).numel() == expect
    assert indices.encode_varint(torch.empty(0, dtype=torch.long)).numel() == 0


def test_varint_single_byte_gaps_are_plain_bytes():
    pos = torch.arange(0, 100, 3)
    data = indices.encode_varint(pos)
    assert data.numel() == pos.numel()
    assert int(data[0]) == 0
    assert bool((data[1:] == 2).all())


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=40))
def test_varint_large_gaps(gaps):
    pos = torch.tensor(gaps, dtype=torch.long).add(1).cumsum(0).sub(1)
    total = int(pos[-1]) + 1 + 5
    data = indices.encode_varint(pos)
    assert data.numel() == leb128_length(pos)
    assert torch.equal(indices.decode_varint(data, pos.numel(), total), pos)


def test_varint_gap_of_2_pow_40_and_boundaries():
    for gap in (127, 128, 2**14 - 1, 2**14, 2**21, 2**28, 2**35, 2**40, 2**42 - 1):
        pos = torch.tensor([gap, gap + 1, 2 * gap + 2], dtype=torch.long)
        data = indices.encode_varint(pos)
        assert torch.equal(indices.decode_varint(data, 3, 2 * gap + 3), pos)


def test_empty_positions():
    empty = torch.empty(0, dtype=torch.long)
    assert indices.encode_varint(empty).numel() == 0
    assert indices.decode_varint(torch.empty(0, dtype=torch.uint8), 0, 10).numel() == 0
    assert indices.decode_bitmap(indices.encode_bitmap(empty, 10), 10).numel() == 0
    assert indices.decode_bitmap(indices.encode_bitmap(empty, 0), 0).numel() == 0


# ---- rejection -------------------------------------------------------------------------------


def test_varint_rejects_truncated_stream():
    pos = positions_of([5, 300, 70000, 2**30])
    data = indices.encode_varint(pos)
    for cut in range(data.numel()):
        with pytest.raises(PayloadError):
            indices.decode_varint(data[:cut], pos.numel(), 2**31)


def test_varint_rejects_dangling_continuation():
    data = torch.tensor([3, 0x85], dtype=torch.uint8)  # one complete varint, then an unfinished one
    with pytest.raises(PayloadError):
        indices.decode_varint(data, 1, 100)
    with pytest.raises(PayloadError):
        indices.decode_varint(data, 2, 100)


def test_varint_rejects_count_mismatch():
    pos = positions_of([1, 5, 9, 30])
    data = indices.encode_varint(pos)
    for count in (0, 1, 3, 5, 100):
        with pytest.raises(PayloadError):
            indices.decode_varint(data, count, 100)
    with pytest.raises(PayloadError):
        indices.decode_varint(torch.empty(0, dtype=torch.uint8), 2, 100)


def test_varint_rejects_positions_past_the_end():
    pos = positions_of([1, 5, 9, 30])
    data = indices.encode_varint(pos)
    assert torch.equal(indices.decode_varint(data, 4, 31), pos)
    for total in (0, 1, 10, 30):
        with pytest.raises(PayloadError):
            indices.decode_varint(data, 4, total)


def test_varint_rejects_huge_gaps_without_overflow():
    # Many maximal 9-byte gaps: the running sum would overflow int64 if not checked first.
    one = [0xFF] * 8 + [0x7F]
    data = torch.tensor(one * 4, dtype=torch.uint8)
    with pytest.raises(PayloadError):
        indices.decode_varint(data, 4, 2**31)


def test_varint_rejects_overlong():
    data = torch.tensor([0x80] * 12 + [0x01], dtype=torch.uint8)
    with pytest.raises(PayloadError):
        indices.decode_varint(data, 1, 2**62)


@given(st.binary(max_size=64), st.integers(0, 40), st.integers(0, 5000))
def test_varint_random_bytes_only_payload_error(raw, count, total):
    data = torch.tensor(list(raw), dtype=torch.uint8)
    try:
        pos = indices.decode_varint(data, count, total)
    except PayloadError:
        return
    assert pos.numel() == count
    if count:
        assert bool((pos.diff() > 0).all())
        assert 0 <= int(pos[0]) and int(pos[-1]) < total


def test_bitmap_rejects_wrong_length():
    pos = positions_of([0, 3, 9])
    data = indices.encode_bitmap(pos, 12)
    with pytest.raises(PayloadError):
        indices.decode_bitmap(data[:-1], 12)
    with pytest.raises(PayloadError):
        indices.decode_bitmap(torch.cat([data, data[:1]]), 12)


def test_bitmap_rejects_bits_past_the_end():
    data = indices.encode_bitmap(positions_of([0, 3, 9]), 12).clone()
    data[-1] |= 0x80  # bit 15, past the 12 elements
    with pytest.raises(PayloadError):
        indices.decode_bitmap(data, 12)


@given(st.binary(max_size=40), st.integers(0, 320))
def test_bitmap_random_bytes_only_payload_error(raw, total):
    data = torch.tensor(list(raw), dtype=torch.uint8)
    try:
        pos = indices.decode_bitmap(data, total)
    except PayloadError:
        return
    assert pos.numel() == 0 or int(pos[-1]) < total
