"""TopK selection math: per sample, over the flattened sample, by absolute value.

Exactly ceil(K * n) values are kept per sample. The selection is a sorted vector of flat
positions into the whole tensor: values are read with index_select and written back into
zeros, and the wire codes the positions.

On CPU, long float32 rows (the activations TopK is for) are selected with numpy, one row at a
time, which does less work than torch.topk (that selects and moves (value, index) pairs): the k-th
largest magnitude of a fixed random sample gives a value that, with high probability, a little
more than k of the row reach; flatnonzero of one comparison gives those candidates as sorted
positions, and numpy's introselect (np.partition) of their magnitudes the exact threshold. If
the estimate was too high (too few candidates), the candidates are the row's non-zeros instead:
exact zeros, half of a post-ReLU activation, are never partitioned (introselect slows down on
long runs of equal values). Of values tied at the threshold the first ones are kept, zeros
included when a row has fewer than k non-zeros. Short rows, float64 and tensors on other
devices use torch.topk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from protocols.wire import rows_of


@dataclass(frozen=True)
class Selection:
    """Where a TopK message kept its values; remembered for reused-index gradients."""

    positions: torch.Tensor  # sorted flat int64 positions into the whole tensor
    kept_per_sample: int
    digest: int  # crc32 of the index bytes on the wire


def kept_per_sample(ratio: float, per_sample: int) -> int:
    # The ratio's shortest decimal form keeps ceil exact: ceil(0.1 * 10) must be 1, not 2.
    return math.ceil(Fraction(repr(float(ratio))) * per_sample)


def _exact(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    rows, n = magnitude.shape
    top = torch.topk(magnitude, k, dim=1, sorted=False).indices
    mask = torch.zeros((rows, n), dtype=torch.bool, device=magnitude.device)
    mask.scatter_(1, top, True)
    return mask.view(-1).nonzero().squeeze(1)


# Rows shorter than this go to torch.topk: per-row numpy calls would cost more than they save.
_MIN_ROW = 4096
# Sample size for the threshold estimate, and its margin in standard deviations of the count.
_SAMPLE = 1024
_MARGIN = 4.0
_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)  # `>= _TINY` is `> 0` for magnitudes
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


@functools.lru_cache(maxsize=8)
def _sample_at(n: int) -> np.ndarray:
    """Fixed random positions (a strided sample would see a few channels of a [tokens, width] row)."""
    return np.sort(np.random.default_rng(0).integers(0, n, _SAMPLE))


def _estimate(row: np.ndarray, k: int) -> np.float32:
    """A magnitude that (with high probability) a little more than k values of the row reach."""
    share = k / row.size
    rank = min(_SAMPLE, math.ceil(_SAMPLE * share + _MARGIN * math.sqrt(_SAMPLE * share * (1 - share))) + 1)
    sample = row[_sample_at(row.size)]
    return np.partition(sample, _SAMPLE - rank)[_SAMPLE - rank]


def _row_top(row: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the k largest of a row of magnitudes; at the threshold the first ties."""
    candidates = np.flatnonzero(row >= max(_estimate(row, k), _TINY))
    if candidates.size < k:  # the estimate was too high: every non-zero is a candidate
        candidates = np.flatnonzero(row)
        if candidates.size < k:  # and then the first zeros
            zeros = np.flatnonzero(row == 0)[: k - candidates.size]
            return np.sort(np.concatenate([candidates, zeros]))
    values = row[candidates]
    cut = values.size - k
    threshold = np.partition(values, cut)[cut]
    keep = values >= threshold
    excess = int(np.count_nonzero(keep)) - k
    if excess:  # equal values at the threshold: drop the last ones
        tied = np.flatnonzero(values == threshold)
        keep[tied[tied.size - excess :]] = False
    return np.compress(keep, candidates)  # faster than boolean indexing


def _partition_select(x: np.ndarray, k: int) -> torch.Tensor:
    """Sorted flat top-k positions of |x| for every row of a [rows, n] float32 array."""
    n = x.shape[1]
    out = np.empty((x.shape[0], k), dtype=np.int64)
    magnitude = np.empty(n, dtype=np.float32)  # one row at a time: stays in cache for the passes
    for r, row in enumerate(x):
        np.add(_row_top(np.abs(row, out=magnitude), k), r * n, out=out[r])
    return torch.from_numpy(out.reshape(-1))


def top_positions(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, int]:
    """Sorted flat positions of the ceil(ratio * n) largest |x| of every sample, and that count."""
    shape = tuple(x.shape)
    rows = rows_of(shape)
    total = x.numel()
    per_sample = total // rows if rows else 0
    k = kept_per_sample(ratio, per_sample)
    if k >= per_sample:
        return torch.arange(total, device=x.device), per_sample
    flat = x.detach().reshape(rows, per_sample)
    if (
        flat.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and per_sample >= _MIN_ROW
    ):
        return _partition_select(flat.float().numpy(), k), k
    return _exact(flat.abs(), k), k


def gather(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).index_select(0, positions.to(x.device))


def scatter(
    values: torch.Tensor, positions: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device=None
) -> torch.Tensor:
    if dtype in _NUMPY_DTYPES and (device is None or torch.device(device).type == "cpu"):
        # numpy: torch.zeros and index_copy_ stall on their thread pool while other processes hold the cores
        out = np.zeros(math.prod(shape), dtype=_NUMPY_DTYPES[dtype])
        out[positions.cpu().numpy()] = values.to(dtype).cpu().numpy()
        return torch.from_numpy(out).view(shape)
    out = torch.zeros(math.prod(shape), dtype=dtype, device=device)
    out.index_copy_(0, positions.to(out.device), values.to(device=out.device, dtype=dtype))
    return out.view(shape)
