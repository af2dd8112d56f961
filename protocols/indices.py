"""Coding of TopK positions: a bitmap or LEB128 varints of the gaps, whichever is smaller.

Positions are sorted flat indices into the whole tensor. A bitmap costs one bit per element;
gap varints cost about one byte per kept value while gaps stay under 128 (K >= ~1%), so the
bitmap wins above K = 1/8 and varints below. Both decoders validate what they read.
"""

from __future__ import annotations

import numpy as np
import torch

from protocols.bitpack import pack, unpack
from protocols.errors import PayloadError

_MAX_VARINT_BYTES = 9  # 63-bit positions


def _gaps(positions: np.ndarray) -> np.ndarray:
    """Gaps between sorted positions, minus one; the first is the first position."""
    gaps = np.empty_like(positions)
    gaps[:1] = positions[:1]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    return gaps


def _extra_bytes(gaps: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The bytes after the first of every varint: (insert-before index, byte) per level.

    Gaps of 128 and more are rare for TopK (K >= ~1%), so this works on that subset only.
    """
    levels = []
    at = np.flatnonzero(gaps >= 0x80)
    rest = gaps[at] >> 7
    at = at + 1
    while at.size:
        more = rest >= 0x80
        levels.append((at, ((rest & 0x7F) | (more.astype(np.int64) << 7)).astype(np.uint8)))
        keep = np.flatnonzero(more)
        at, rest = at[keep], rest[keep] >> 7
    return levels


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
    if total % 8 and int(data[-1]) >> (total % 8):  # the last byte holds the last total % 8 bits
        raise PayloadError("bitmap has bits set past the end of the tensor")
    return unpack(data, 1, total).nonzero().squeeze(1)


def encode_indices(positions: torch.Tensor, total: int) -> tuple[str, torch.Tensor]:
    """The cheaper coding of sorted positions: ("bitmap" | "varint", bytes as a uint8 tensor)."""
    if positions.numel() >= bitmap_length(total):  # varints take at least a byte per position
        return "bitmap", encode_bitmap(positions, total)
    gaps = _gaps(positions.cpu().numpy())
    extra = _extra_bytes(gaps)
    if gaps.size + sum(at.size for at, _ in extra) >= bitmap_length(total):
        return "bitmap", encode_bitmap(positions, total)
    return "varint", _encode_varint(gaps, extra)


def encode_varint(positions: torch.Tensor) -> torch.Tensor:
    """Sorted positions -> gap varints (LEB128: low 7 bits first, high bit = more bytes follow)."""
    gaps = _gaps(positions.cpu().numpy())
    return _encode_varint(gaps, _extra_bytes(gaps))


def _encode_varint(gaps: np.ndarray, extra: list[tuple[np.ndarray, np.ndarray]]) -> torch.Tensor:
    first = gaps.astype(np.uint8)  # the low 8 bits (gaps are >= 0); uint8 `&` is the cheaper pass
    first &= 0x7F
    if not extra:
        return torch.from_numpy(first)
    first[extra[0][0] - 1] |= 0x80
    at = np.concatenate([a for a, _ in extra])
    values = np.concatenate([v for _, v in extra])
    order = np.argsort(at, kind="stable")  # a varint's bytes stay in level order
    return torch.from_numpy(np.insert(first, at[order], values[order]))


def decode_varint(data: torch.Tensor, count: int, total: int) -> torch.Tensor:
    """Positions from gap varints; exactly `count` of them, strictly increasing, below `total`."""
    raw = data.cpu().numpy()
    if raw.size == 0:
        if count:
            raise PayloadError(f"index stream is empty, expected {count} positions")
        return torch.empty(0, dtype=torch.long)
    ends = raw < 0x80
    found = int(np.count_nonzero(ends))
    if found != count:
        raise PayloadError(f"index stream holds {found} positions, expected {count}")
    if not ends[-1]:
        raise PayloadError("index stream ends inside a varint")
    gaps = raw if found == raw.size else _multi_byte_gaps(raw, ends, total)
    positions = np.cumsum(gaps, dtype=np.int64)  # position i = gap 0 + ... + gap i + i
    positions += np.arange(count)
    if int(positions[-1]) >= total:  # gaps are >= 0: positions increase, the last is the largest
        raise PayloadError(f"index {int(positions[-1])} is past the tensor's {total} elements")
    return torch.from_numpy(positions)


def _multi_byte_gaps(raw: np.ndarray, ends: np.ndarray, total: int) -> np.ndarray:
    """Gaps of a stream with some multi-byte varints (rare: gaps of 128 and more)."""
    gaps = raw[ends].astype(np.int64)  # the final byte of every varint
    cont = np.flatnonzero(~ends)  # the leading bytes of the multi-byte varints
    # A run of consecutive leading bytes and the byte after it are one varint.
    first = np.empty(cont.size, dtype=bool)
    first[0] = True
    np.not_equal(np.diff(cont), 1, out=first[1:])
    runs = np.flatnonzero(first)
    lengths = np.diff(runs, append=cont.size)  # leading bytes per multi-byte varint
    if int(lengths.max()) >= _MAX_VARINT_BYTES:
        raise PayloadError("index stream has an overlong varint")
    starts = cont[runs]
    level = cont - np.repeat(starts, lengths)  # byte number within its varint
    low = (raw[cont] & 0x7F).astype(np.int64) << (7 * level)
    at = starts + lengths - np.cumsum(lengths)  # which varint: final bytes before this one
    value = (gaps[at] << (7 * lengths)) + np.add.reduceat(low, runs)  # the final byte holds the highest bits
    if int(value.max()) >= total:  # (at most 63 bits) also keeps the running sum from overflowing
        raise PayloadError(f"index gap {int(value.max())} is past the tensor's {total} elements")
    gaps[at] = value
    return gaps
