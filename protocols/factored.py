"""Factored bodies on the wire: low-rank (two factors) and subspace (coefficients in a basis).

Both view the tensor as a matrix, rows x cols (`values.matrix_of`), and store each factor
transposed, one row per rank component (a quantized factor has one range per component). Decoding
checks the rank against the matrix, every length, and that the product cannot overflow float32
before anything is multiplied.
"""

from __future__ import annotations

from protocols import compressed_tensor_pb2 as pb
from protocols.errors import PayloadError
from protocols.message import LowRankPart, QuantPart, RawPart, SubspacePart
from protocols.values import FLOAT32_MAX, BufferBytes, extremes, largest, matrix_of, values_from, values_segments

# An orthonormal row has entries in [-1, 1]; the slack covers float rounding of a unit entry.
BASIS_BOUND = 1.001


def low_rank_segments(part: LowRankPart, check: BufferBytes) -> list:
    return [
        pb.LowRank(rank=part.rank).SerializeToString(),
        *values_segments(2, part.left, check),
        *values_segments(4, part.right, check),
    ]


def subspace_segments(part: SubspacePart, check: BufferBytes) -> list:
    segments = [
        pb.Subspace(rank=part.rank, basis_version=part.basis_version).SerializeToString(),
        *values_segments(3, part.coefficients, check),
    ]
    return segments if part.basis is None else [*segments, *values_segments(5, part.basis, check)]


def _check_rank(kind: str, rank: int, rows: int, cols: int, bound: int | None = None) -> None:
    if rank > (min(rows, cols) if bound is None else bound):  # also bounds each factor by the element count
        raise PayloadError(f"{kind} payload of rank {rank} for a {rows} x {cols} matrix")


def low_rank_from(msg: pb.LowRank, shape: tuple[int, ...], check: BufferBytes) -> LowRankPart:
    rows, cols = matrix_of(shape)
    _check_rank("low-rank", msg.rank, rows, cols)
    left = values_from(msg, "left", (msg.rank, rows), check, "low-rank left factor")
    right = values_from(msg, "right", (msg.rank, cols), check, "low-rank right factor")
    return LowRankPart(msg.rank, left, right)


def subspace_from(msg: pb.Subspace, shape: tuple[int, ...], check: BufferBytes) -> SubspacePart:
    rows, cols = matrix_of(shape)
    # a basis found from this tensor has rank <= rows; a held one may serve a smaller micro-batch
    _check_rank("subspace", msg.rank, rows, cols, None if msg.WhichOneof("basis") else cols)
    coefficients = values_from(msg, "coefficients", (msg.rank, rows), check, "subspace coefficients")
    basis = None
    if msg.WhichOneof("basis") is not None:
        basis = values_from(msg, "basis", (msg.rank, cols), check, "subspace basis")
    elif msg.basis_version == 0:
        raise PayloadError("a standalone subspace payload (basis version 0) carries no basis")
    return SubspacePart(msg.rank, msg.basis_version, coefficients, basis)


def check_low_rank_finite(part: LowRankPart) -> None:
    """The factors are finite and their product, computed in float32, cannot overflow: each
    element is a sum of `rank` products of one value of each factor. (A decoder saturates what a
    narrower dtype cannot hold.)"""
    bound = part.rank * largest(part.left) * largest(part.right)
    if not bound <= FLOAT32_MAX:  # also NaN
        raise PayloadError("low-rank factors are not finite, or their product overflows float32")


def _within_basis_bound(part: RawPart | QuantPart) -> bool:
    values = extremes(part)
    return not values.numel() or float(values.double().abs().max()) <= BASIS_BOUND  # NaN compares False


def check_subspace_finite(part: SubspacePart) -> None:
    """A carried basis has the entries of orthonormal rows (so a basis held from an earlier message
    has too), and coefficients finite with a product that cannot overflow float32."""
    if part.basis is not None and not _within_basis_bound(part.basis):
        raise PayloadError(f"subspace basis values are not finite or outside [-{BASIS_BOUND}, {BASIS_BOUND}]")
    if not part.rank * largest(part.coefficients) * BASIS_BOUND <= FLOAT32_MAX:  # also NaN
        raise PayloadError("subspace coefficients are not finite, or their product overflows float32")
