"""Dense bit packing of k-bit codes (k = 1..8) into bytes: exactly ceil(n * k / 8) per row.

Codes go in groups of g = 8 / gcd(k, 8) whose g * k bits fill B = g * k / 8 whole bytes (4 six-bit
codes in 3 bytes, 8 three-bit codes in 3 bytes, 2 nibbles in 1 byte); within a group, code j
takes bits [j * k, (j + 1) * k), little-endian. The layout is planar: with m full groups (m a
multiple of 8), code j of group i is codes[j * m + i] and byte b of group i is stored at
b * m + i. Every step is then one shift and one mask over contiguous runs, done 8 bytes at a time
on uint64 words in numpy (single-threaded, so it does not stall when other processes hold the
cores, as torch's thread pool does). The remaining codes (fewer than 8 * g) follow as one
little-endian bit string of ceil(rest * k / 8) bytes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

_BYTES = np.uint64(0x0101010101010101)  # a byte value times this repeats it in every byte of a word


def packed_length(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits occupy."""
    return -(-count * bits // 8)


@functools.lru_cache(maxsize=8)
def _layout(bits: int) -> tuple[int, int, tuple[tuple[int, int, int, int], ...]]:
    """(codes per group, bytes per group, (code, byte, lo, hi) for every code bit range [lo, hi)
    of a byte that a code of the group covers)."""
    codes = 8 // math.gcd(bits, 8)
    size = codes * bits // 8
    overlaps = []
    for j in range(codes):
        for b in range(size):
            lo, hi = max(j * bits, 8 * b), min((j + 1) * bits, 8 * b + 8)
            if lo < hi:
                overlaps.append((j, b, lo - 8 * b, hi - 8 * b))
    return codes, size, tuple(overlaps)


def _shift_into(dest: np.ndarray, x: np.ndarray, left: int, right: int, width: int, accumulate: bool) -> None:
    """dest (|)= (x << left) >> right on every byte of the uint64 words x, whose bytes are < 2**width."""
    net = left - right
    target = None if accumulate else dest
    y = x
    if net:
        y = (np.left_shift if net > 0 else np.right_shift)(x, np.uint64(abs(net)), out=target)
    # bits that crossed into a neighbouring byte, or that the uint8 shifts would have dropped
    if net < 0 or width + left > 8:
        y = np.bitwise_and(y, np.uint64(((0xFF << left) & 0xFF) >> right) * _BYTES, out=target if y is x else y)
    if accumulate:
        dest |= y
    elif y is x:
        dest[...] = x


def _split(n: int, bits: int) -> tuple[int, int, int]:
    """(codes per group, bytes per group, plane length m): m full groups, m a multiple of 8."""
    g, size, _ = _layout(bits)
    return g, size, n // (8 * g) * 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2**bits) along the last dim into packed_length bytes.

    A 1-D input gives one byte stream; a 2-D input packs every row on its own, so rows can be
    stored and read back separately.
    """
    if bits == 8:
        return codes
    n = codes.shape[-1]
    g, size, m = _split(n, bits)
    lead = codes.shape[:-1]
    src = np.ascontiguousarray(codes.detach().cpu().numpy()).reshape(math.prod(lead), n)
    out = np.empty((math.prod(lead), packed_length(n, bits)), dtype=np.uint8)
    if m:
        planes, packed = src[:, : g * m].view(np.uint64), out[:, : size * m].view(np.uint64)
        w = m // 8
        done = set()
        for j, b, lo, _ in _layout(bits)[2]:  # code bits from 8b + lo - jk on go to byte bit lo
            _shift_into(
                packed[:, b * w : (b + 1) * w],
                planes[:, j * w : (j + 1) * w],
                lo,
                8 * b + lo - j * bits,
                bits,
                b in done,
            )
            done.add(b)
    if n > g * m:
        rest = np.unpackbits(src[:, g * m :, None], axis=-1, count=bits, bitorder="little")
        out[:, size * m :] = np.packbits(rest.reshape(len(src), (n - g * m) * bits), axis=-1, bitorder="little")
    return torch.from_numpy(out).view(*lead, out.shape[1]).to(codes.device)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack`: `count` uint8 codes per row. The caller has checked the length."""
    if bits == 8:
        return packed[..., :count]
    g, size, m = _split(count, bits)
    lead = packed.shape[:-1]
    src = np.ascontiguousarray(packed.detach().cpu().numpy()).reshape(math.prod(lead), packed.shape[-1])
    out = np.empty((math.prod(lead), count), dtype=np.uint8)
    if m:
        planes, codes = src[:, : size * m].view(np.uint64), out[:, : g * m].view(np.uint64)
        w = m // 8
        done = set()
        for j, b, lo, hi in _layout(bits)[2]:  # byte bits [lo, hi) go to code bits from 8b + lo - jk on
            # (byte << (8 - hi)) drops the bits above hi; shifting back lands the rest in place
            right = 8 - hi + lo - (8 * b + lo - j * bits)
            _shift_into(codes[:, j * w : (j + 1) * w], planes[:, b * w : (b + 1) * w], 8 - hi, right, 8, j in done)
            done.add(j)
    if count > g * m:
        rest = np.unpackbits(src[:, size * m :], axis=-1, count=(count - g * m) * bits, bitorder="little")
        out[:, g * m :] = np.packbits(rest.reshape(len(src), count - g * m, bits), axis=-1, bitorder="little")[..., 0]
    return torch.from_numpy(out).view(*lead, count).to(packed.device)
