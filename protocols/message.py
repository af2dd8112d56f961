"""In-memory form of a compressed tensor: what the codec math produces and the wire packs.

Tensors here are flat and on any device; `protocols.wire` moves them to bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Granularity(enum.StrEnum):
    """Which elements share one quantization range."""

    TENSOR = "tensor"
    SAMPLE = "sample"
    CHANNEL = "channel"


@dataclass(frozen=True)
class RawPart:
    """Values as they are, in the dtype they travel in (flat)."""

    data: torch.Tensor


@dataclass(frozen=True)
class QuantPart:
    """k-bit codes (uint8, one per element, flat) with one (low, step) pair per group."""

    bits: int
    granularity: Granularity
    codes: torch.Tensor
    lows: torch.Tensor
    steps: torch.Tensor


@dataclass(frozen=True)
class SparsePart:
    """TopK: `kept_per_sample` values per row at sorted flat `positions` (int64).

    `positions` is None when the indices are reused from the forward message; `index_digest`
    then names that message's index bytes so a mismatch is caught.
    """

    kept_per_sample: int
    positions: torch.Tensor | None
    values: RawPart | QuantPart
    index_digest: int = 0


@dataclass(frozen=True)
class LowRankPart:
    """Low rank: the tensor as a [rows, cols] matrix (cols its last dimension) is left^T @ right.

    Factors are transposed, one row per rank component: `left` holds [rank, rows] values, `right`
    [rank, cols] (flat, as a `RawPart`, or quantized with one range per component).
    """

    rank: int
    left: RawPart | QuantPart
    right: RawPart | QuantPart


@dataclass(frozen=True)
class SubspacePart:
    """Subspace: the tensor as a [rows, cols] matrix is coefficients^T @ basis, with `basis`
    [rank, cols] (orthonormal rows) held by both ends of the link, or carried here (`basis` not
    None) to be installed as version `basis_version`. Laid out like `LowRankPart`'s factors:
    `coefficients` [rank, rows] like its left, `basis` like its right. Version 0: a standalone
    message with its own basis, outside the link's state.
    """

    rank: int
    basis_version: int
    coefficients: RawPart | QuantPart
    basis: RawPart | QuantPart | None = None


@dataclass(frozen=True)
class StateStamp:
    """Version of the mirrored error-feedback state a message was computed against."""

    version: int = 0
    sample_versions: tuple[int, ...] = ()
    warmup: bool = False


@dataclass
class Encoded:
    """A compressed tensor: its original shape and dtype and one body."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    body: RawPart | QuantPart | SparsePart | LowRankPart | SubspacePart
    stamp: StateStamp | None = None
    # Filled by protocols.wire: crc32 of the index bytes (what a reused-index reply names).
    index_digest: int = field(default=0, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n
