"""Coding of TopK positions: a bitmap or LEB128 varints of the gaps, whichever is smaller.

Positions are sorted flat indices into the whole tensor. A bitmap costs one bit per element;
gap varints cost about one byte per kept value while gaps stay under 128 (K >= ~1%), so the
bitmap wins above K = 1/8 and varints below. Both decoders validate what they read.
"""

from __future__ import annotations

import torch

from protocols.bitpack import pack, unpack
from protocols.errors import PayloadError

_MAX_VARINT_BYTES = 9  # 63-bit positions


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    """Gaps between sorted positions, minus one; the first is the first position."""
    gaps = positions.diff(prepend=positions.new_full((1,), -1))
    return gaps.sub_(1)


def _varint_lengths(gaps: torch.Tensor) -> torch.Tensor:
    lengths = torch.ones_like(gaps)
    largest = int(gaps.max()) if gaps.numel() else 0
    for level in range(1, _MAX_VARINT_BYTES):
        if largest < (1 << (7 * level)):
            break
        lengths += gaps >= (1 << (7 * level))
    return lengths


def bitmap_length(total: int) -> int:
    return -(-total // 8)


def encode_bitmap(positions: torch.Tensor, total: int) -> torch.Tensor:
    """Sorted positions -> packed bits."""
    mask = torch.zeros(total, dtype=torch.uint8, device=positions.device)
    mask.index_fill_(0, positions, 1)
    return pack(mask, 1)


def decode_bitmap(data: torch.Tensor, total: int) -> torch.Tensor:
    """Packed bits -> sorted positions."""
    if data.numel() != bitmap_length(total):
        raise PayloadError(f"bitmap has {data.numel()} bytes, expected {bitmap_length(total)}")
    bits = unpack(data, 1, data.numel() * 8)
    if total % 8 and bool(bits[total:].any()):
        raise PayloadError("bitmap has bits set past the end of the tensor")
    return bits[:total].nonzero().squeeze(1)


def encode_indices(positions: torch.Tensor, total: int) -> tuple[str, torch.Tensor]:
    """The cheaper coding of sorted positions: ("bitmap" | "varint", bytes as a uint8 tensor)."""
    if positions.numel() >= bitmap_length(total):  # varints take at least a byte per position
        return "bitmap", encode_bitmap(positions, total)
    gaps = _gaps(positions)
    lengths = _varint_lengths(gaps)
    if int(lengths.sum()) >= bitmap_length(total):
        return "bitmap", encode_bitmap(positions, total)
    return "varint", _encode_varint(gaps, lengths)


def encode_varint(positions: torch.Tensor) -> torch.Tensor:
    """Sorted positions -> gap varints."""
    gaps = _gaps(positions)
    return _encode_varint(gaps, _varint_lengths(gaps))


def _encode_varint(gaps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    if gaps.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=gaps.device)
    longest = int(lengths.max())
    if longest == 1:  # the common case: every gap fits in one byte
        return gaps.to(torch.uint8)
    extra = lengths - 1
    starts = torch.arange(gaps.numel(), device=gaps.device) + (extra.cumsum(0) - extra)
    out = torch.empty(int(starts[-1] + lengths[-1]), dtype=torch.uint8, device=gaps.device)
    out[starts] = ((gaps & 0x7F) | ((extra > 0).long() << 7)).to(torch.uint8)
    for level in range(1, longest):  # the rare multi-byte gaps, one byte level at a time
        sel = (lengths > level).nonzero().squeeze(1)
        more = (lengths[sel] > level + 1).long() << 7
        out[starts[sel] + level] = (((gaps[sel] >> (7 * level)) & 0x7F) | more).to(torch.uint8)
    return out


def decode_varint(data: torch.Tensor, count: int, total: int) -> torch.Tensor:
    """Positions from gap varints; exactly `count` of them, strictly increasing, below `total`."""
    size = data.numel()
    if size == 0:
        if count:
            raise PayloadError(f"index stream is empty, expected {count} positions")
        return torch.empty(0, dtype=torch.long, device=data.device)
    ends = data < 0x80
    found = int(torch.count_nonzero(ends))
    if found != count:
        raise PayloadError(f"index stream holds {found} positions, expected {count}")
    if not bool(ends[-1]):
        raise PayloadError("index stream ends inside a varint")
    if found == size:
        gaps = data.long()
    else:
        last = ends.nonzero().squeeze(1)  # the final byte of every varint
        first = torch.zeros_like(last)
        first[1:] = last[:-1] + 1
        span = last - first
        if int(span.max()) >= _MAX_VARINT_BYTES:
            raise PayloadError("index stream has an overlong varint")
        gaps = data[last].long()
        multi = (span > 0).nonzero().squeeze(1)  # rare: gaps of 128 or more
        first_m, span_m = first[multi], span[multi]
        value = torch.zeros_like(first_m)
        for level in range(int(span_m.max()) + 1):
            byte = (data[torch.minimum(first_m + level, last[multi])] & 0x7F).long()
            value += torch.where(span_m >= level, byte << (7 * level), 0)
        gaps[multi] = value
    if int(gaps.max()) >= total:  # also keeps the running sum below from overflowing
        raise PayloadError(f"index gap {int(gaps.max())} is past the tensor's {total} elements")
    positions = gaps.add_(1).cumsum(0).sub_(1)
    if int(positions[-1]) >= total:
        raise PayloadError(f"index {int(positions[-1])} is past the tensor's {total} elements")
    return positions
