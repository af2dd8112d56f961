"""protocols.bitpack: dense k-bit packing, 1-D and row-wise 2-D."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocols import bitpack

BITS = list(range(1, 9))


def codes(shape, bits, gen=None):
    return torch.randint(0, 1 << bits, tuple(shape), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000])
def test_roundtrip_1d(bits, count):
    c = codes((count,), bits)
    packed = bitpack.pack(c, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (bitpack.packed_length(count, bits),)
    out = bitpack.unpack(packed, bits, count)
    assert out.dtype == torch.uint8
    assert torch.equal(out, c)


@given(bits=st.integers(1, 8), count=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_random_lengths(bits, count, seed):
    g = torch.Generator().manual_seed(seed)
    c = codes((count,), bits, g)
    packed = bitpack.pack(c, bits)
    assert packed.numel() == bitpack.packed_length(count, bits)
    assert torch.equal(bitpack.unpack(packed, bits, count), c)


@pytest.mark.parametrize("bits", BITS)
def test_extreme_codes(bits):
    top = (1 << bits) - 1
    for fill in (0, top):
        c = torch.full((37,), fill, dtype=torch.uint8)
        assert torch.equal(bitpack.unpack(bitpack.pack(c, bits), bits, 37), c)
    alt = torch.tensor([0, top] * 20, dtype=torch.uint8)
    assert torch.equal(bitpack.unpack(bitpack.pack(alt, bits), bits, alt.numel()), alt)


@pytest.mark.parametrize("bits", BITS)
def test_packed_length_costs_k_bits(bits):
    for count in range(0, 200):
        n = bitpack.packed_length(count, bits)
        # Never less than the information content, and at most one partial byte per field.
        assert n >= math.ceil(count * bits / 8)
        assert n <= math.ceil(count * bits / 8) + 3
    assert bitpack.packed_length(0, bits) == 0
    assert bitpack.packed_length(8, bits) == bits  # 8 codes of k bits are exactly k bytes


@pytest.mark.parametrize("bits", BITS)
def test_pack_does_not_modify_input(bits):
    c = codes((50,), bits)
    before = c.clone()
    bitpack.pack(c, bits)
    assert torch.equal(c, before)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (4, 8), (5, 13), (2, 64), (3, 0)])
def test_rowwise_2d_equals_per_row(bits, rows, cols):
    c = codes((rows, cols), bits)
    packed = bitpack.pack(c, bits)
    assert packed.shape == (rows, bitpack.packed_length(cols, bits))
    for r in range(rows):
        assert torch.equal(packed[r], bitpack.pack(c[r].contiguous(), bits))
    out = bitpack.unpack(packed, bits, cols)
    assert out.shape == (rows, cols)
    assert torch.equal(out, c)


def test_rowwise_2d_zero_rows():
    """A batch of zero samples (e.g. an empty micro-batch row-packed by SampleStore) packs to
    zero rows for every width, like it already does for bits=8."""
    for bits in BITS:
        for cols in (0, 5):
            c = torch.zeros((0, cols), dtype=torch.uint8)
            packed = bitpack.pack(c, bits)
            assert packed.shape == (0, bitpack.packed_length(cols, bits)), bits
            assert bitpack.unpack(packed, bits, cols).shape == (0, cols), bits


@given(bits=st.integers(1, 8), rows=st.integers(1, 6), cols=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_rowwise_2d_random(bits, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    c = codes((rows, cols), bits, g)
    packed = bitpack.pack(c, bits)
    for r in range(rows):
        assert torch.equal(packed[r], bitpack.pack(c[r].contiguous(), bits))
        assert torch.equal(bitpack.unpack(packed[r].contiguous(), bits, cols), c[r])
    assert torch.equal(bitpack.unpack(packed, bits, cols), c)


@pytest.mark.parametrize("bits", BITS)
def test_non_contiguous_input(bits):
    base = codes((16, 8), bits)
    for c in (base.t(), base[:, ::2], base[::3]):
        packed = bitpack.pack(c, bits)
        assert torch.equal(packed, bitpack.pack(c.contiguous(), bits))
        assert torch.equal(bitpack.unpack(packed, bits, c.shape[-1]), c)
    flat = codes((41,), bits)[::2]
    assert torch.equal(bitpack.unpack(bitpack.pack(flat, bits), bits, flat.numel()), flat)


@pytest.mark.parametrize("bits", BITS)
def test_layout_is_deterministic_bit_order(bits):
    """Packing is a fixed function of the codes: equal inputs give equal bytes, and a change in
    any single code changes the bytes (packing is injective)."""
    c = codes((29,), bits)
    ref = bitpack.pack(c, bits)
    for i in range(c.numel()):
        d = c.clone()
        d[i] = (int(d[i]) + 1) % (1 << bits)
        assert not torch.equal(bitpack.pack(d, bits), ref)
    assert torch.equal(bitpack.pack(c.clone(), bits), ref)
