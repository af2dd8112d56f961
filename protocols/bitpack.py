"""Dense bit packing of k-bit codes (k = 1..8) into bytes.

A k-bit code is split into fields of widths 4, 2 and 1 (k = 4 + 2 + 1 at most, 8 as itself);
each field is packed separately with the simple per-byte scheme for widths that divide 8, and the
streams are concatenated. Every width costs exactly ceil(n * w / 8) bytes, so a code costs k bits
and only shifts and ORs run: fast on CPU and GPU alike.
"""

from __future__ import annotations

import torch

_FIELDS: dict[int, tuple[int, ...]] = {
    1: (1,),
    2: (2,),
    3: (2, 1),
    4: (4,),
    5: (4, 1),
    6: (4, 2),
    7: (4, 2, 1),
    8: (8,),
}


def packed_length(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits occupy."""
    return sum(-(-count * w // 8) for w in _FIELDS[bits])


def _pack_field(values: torch.Tensor, width: int) -> torch.Tensor:
    if width == 8:
        return values
    per_byte = 8 // width
    pad = (-values.shape[-1]) % per_byte
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    lanes = values.view(*values.shape[:-1], values.shape[-1] // per_byte, per_byte)
    out = lanes[..., 0].clone()
    for lane in range(1, per_byte):
        out |= lanes[..., lane] << (width * lane)
    return out


def _unpack_field(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    if width == 8:
        return packed[..., :count]
    per_byte = 8 // width
    lanes = torch.empty((*packed.shape, per_byte), dtype=torch.uint8, device=packed.device)
    for lane in range(per_byte):
        # (byte << left) >> right isolates the lane with shifts only: uint8 `&` is far slower on CPU
        left = 8 - width * (lane + 1)
        torch.bitwise_right_shift(packed << left if left else packed, 8 - width, out=lanes[..., lane])
    return lanes.view(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :count]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2**bits) along the last dim into packed_length bytes.

    A 1-D input gives one byte stream; a 2-D input packs every row on its own, so rows can be
    stored and read back separately.
    """
    fields = _FIELDS[bits]
    if len(fields) == 1:
        return _pack_field(codes, bits)
    parts = []
    shift = bits
    for width in fields:
        shift -= width
        if shift + width == bits:  # the top field: codes < 2**bits, no masking needed
            field = codes >> shift if shift else codes
        else:  # shifts isolate the field (uint8 `&` is far slower on CPU)
            field = (codes << (8 - shift - width)) >> (8 - width)
        parts.append(_pack_field(field, width))
    return torch.cat(parts, dim=-1)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack`: `count` uint8 codes per row. The caller has checked the length."""
    fields = _FIELDS[bits]
    if len(fields) == 1:
        return _unpack_field(packed, bits, count)
    codes = None
    offset = 0
    for width in fields:
        size = -(-count * width // 8)
        field = _unpack_field(packed[..., offset : offset + size], width, count)
        offset += size
        codes = field if codes is None else (codes << width) | field
    return codes
