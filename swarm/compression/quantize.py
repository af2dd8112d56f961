"""k-bit min-max quantization math: codes plus one (low, step) per group of elements.

value = low + code * step with step = (max - min) / (2**bits - 1), so the largest error of
round-to-nearest is step / 2. Constant groups get step 0 and decode exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from protocols.message import Granularity, QuantPart
from protocols.wire import quant_groups

# Ranges below this are treated as constant: their inverse would overflow float32.
_TINY_RANGE = 1e-30
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Fused scaling is used while |x| / step < this: float32 rounding then moves a code by < 2**-12.
_FUSED_LIMIT = float(1 << 12)
# Elements per block of numpy passes: a block (float32 and uint8) stays in the L2 cache.
_BLOCK = 1 << 16


def quantize(
    x: torch.Tensor,
    bits: int,
    granularity: Granularity,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> QuantPart:
    levels = (1 << bits) - 1
    groups = quant_groups(tuple(x.shape), granularity)
    if groups == 0:
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return QuantPart(bits, granularity, torch.empty(0, dtype=torch.uint8, device=x.device), empty, empty)
    rows = x.detach().reshape(groups, -1)
    if rows.dtype == torch.float64:  # codes and ranges are float32: quantize what float32 sees
        rows = rows.float()
    lows, highs = _ranges(rows)
    if not bool(torch.isfinite(lows).all() & torch.isfinite(highs).all()):
        raise ValueError("cannot quantize a tensor with NaN or infinite values")
    span64 = highs.double() - lows.double()  # float32 would overflow for ranges near its limit
    live = span64 > _TINY_RANGE
    inverse = torch.where(live, levels / torch.where(live, span64, 1.0), 0.0).float()
    if float(span64.max()) > _FLOAT32_MAX:  # decoding would overflow: low + code * step
        raise ValueError("cannot quantize: the value range exceeds the float32 range")
    steps = torch.where(live, span64 / levels, 0.0).float()
    # code = trunc((x - low) * inverse + 1/2): round-to-nearest, in [0, levels]. The fused form
    # x * inverse + (1/2 - low * inverse) saves a pass, exact enough while |x| * inverse stays
    # small (always when the range spans zero); far-from-zero groups take the two-step path.
    fused = bool((torch.maximum(lows.abs(), highs.abs()) * inverse < _FUSED_LIMIT).all())
    if fused and not stochastic and _on_numpy(rows):  # the common case: scaled and cast a block at a time
        codes = torch.from_numpy(
            _affine_blocks(rows.numpy(), inverse.numpy(), (0.5 - lows * inverse).numpy(), np.uint8)
        )
        return QuantPart(bits, granularity, codes.reshape(-1), lows, steps)
    if fused:
        scaled = _affine(rows, inverse, 0.5 - lows * inverse)
    else:
        scaled = torch.sub(rows, lows[:, None]).mul_(inverse[:, None]).add_(0.5)
    if stochastic:  # trunc(q + u) instead of trunc(q + 1/2): unbiased
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device).sub_(0.5)
        scaled.add_(noise).clamp_(0, levels)
    # the float -> uint8 cast through numpy: a plain single-threaded loop, where torch's CPU cast is slow
    codes = torch.from_numpy(scaled.numpy().astype(np.uint8)) if _on_numpy(scaled) else scaled.to(torch.uint8)
    return QuantPart(bits, granularity, codes.reshape(-1), lows, steps)


def _ranges(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum of every row, in float32."""
    if _on_numpy(rows):
        x = rows.numpy()
        return torch.from_numpy(x.min(axis=1)), torch.from_numpy(x.max(axis=1))
    # amin and amax separately: torch.aminmax over a dim has a slow CPU kernel
    return rows.amin(dim=1).float(), rows.amax(dim=1).float()


def _on_numpy(t: torch.Tensor) -> bool:
    """CPU math goes through numpy: single-threaded, it does not stall while other processes hold
    the cores as torch's thread pool does (every op waits for its threads), and it is as fast or faster."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.uint8)


def _affine(rows: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """rows * scale + shift per row, in float32: a multiply, then an add (no fused multiply-add,
    so every device rounds the same way)."""
    if _on_numpy(rows):
        return torch.from_numpy(_affine_blocks(rows.numpy(), scale.numpy(), shift.numpy(), np.float32))
    return torch.mul(rows, scale[:, None]).add_(shift[:, None])


def _blocks(groups: int, n: int) -> list[tuple[slice, slice]]:
    """(rows, columns) of [groups, n] in blocks of at most _BLOCK elements: whole rows, or pieces of one."""
    if n >= _BLOCK:
        return [(slice(r, r + 1), slice(c, c + _BLOCK)) for r in range(groups) for c in range(0, n, _BLOCK)]
    step = _BLOCK // n
    return [(slice(r, r + step), slice(None)) for r in range(0, groups, step)]


def _affine_blocks(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, dtype: type) -> np.ndarray:
    """x * scale + shift per row in float32 (a multiply, then an add), stored as dtype. A block at a
    time: its passes run in cache, and no full-size float32 temporary is written."""
    out = np.empty(x.shape, dtype)
    work = np.empty(min(x.size, _BLOCK), np.float32)
    for rows, cols in _blocks(*x.shape):
        src, dst = x[rows, cols], out[rows, cols]
        w = dst if dtype == np.float32 else work[: src.size].reshape(src.shape)
        if src.dtype == np.float32:
            np.multiply(src, scale[rows, None], out=w)
        else:  # uint8 codes: cast first, numpy's mixed uint8 * float32 loop is slower
            w[...] = src
            w *= scale[rows, None]
        w += shift[rows, None]
        if w is not dst:
            dst[...] = w  # trunc to uint8
    return out


def dequantize(
    part: QuantPart, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    groups = part.lows.numel()
    if groups == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    codes = part.codes.to(device)
    # _affine rounds the same on every device: mirrored error-feedback state must be
    # bit-identical on both ends of a link.
    out = _affine(codes.view(groups, -1), part.steps.to(device), part.lows.to(device))
    return out.view(shape).to(dtype)
