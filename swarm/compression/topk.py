"""TopK selection math: per sample, over the flattened sample, by absolute value.

Exactly ceil(K * n) values are kept per sample. The selection is a sorted vector of flat
positions into the whole tensor: values are read with index_select and written back with
index_put, and the wire codes the positions.

On CPU the k-th largest magnitude of every row comes from numpy's introselect (np.partition),
several times faster than torch.topk, which selects (value, index) pairs; one comparison and one
flatnonzero then give the sorted positions directly. Introselect slows down on long runs of equal
values, so exact zeros (half of a post-ReLU activation) are replaced by distinct negative
numbers first; that also decides deterministically which zeros fill a row with fewer than k
non-zeros. Of values tied at a row's threshold the first ones are kept. float64 and tensors on
other devices use torch.topk.
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


@functools.lru_cache(maxsize=8)
def _zero_stand_ins(n: int) -> torch.Tensor:
    """Distinct negative numbers that replace exact zeros (fixed, so selections are deterministic)."""
    rng = np.random.default_rng(0)
    return torch.from_numpy(-1.0 - rng.random(n, dtype=np.float32))


def _partition_select(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted top-k positions of every row via np.partition (CPU float32)."""
    rows, n = magnitude.shape
    zeros = magnitude == 0
    if bool(zeros.any()):  # stand-ins are added to zeros only (addcmul beats torch.where here)
        magnitude = torch.addcmul(magnitude, zeros.to(magnitude.dtype), _zero_stand_ins(n))
    keyed = magnitude.numpy()
    threshold = np.partition(keyed, n - k, axis=1)[:, n - k : n - k + 1]
    mask = keyed >= threshold
    if int(np.count_nonzero(mask)) != rows * k:  # equal values at a threshold: keep the first ones
        for row in np.flatnonzero(np.count_nonzero(mask, axis=1) > k):
            tied = np.flatnonzero(keyed[row] == threshold[row, 0])
            mask[row, tied[len(tied) - (int(np.count_nonzero(mask[row])) - k) :]] = False
    return torch.from_numpy(np.flatnonzero(mask))


def top_positions(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, int]:
    """Sorted flat positions of the ceil(ratio * n) largest |x| of every sample, and that count."""
    shape = tuple(x.shape)
    rows = rows_of(shape)
    total = x.numel()
    per_sample = total // rows if rows else 0
    k = kept_per_sample(ratio, per_sample)
    if k >= per_sample:
        return torch.arange(total, device=x.device), per_sample
    magnitude = x.detach().reshape(rows, per_sample).abs()
    if magnitude.device.type == "cpu" and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return _partition_select(magnitude.float(), k), k
    return _exact(magnitude, k), k


def gather(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).index_select(0, positions.to(x.device))


def scatter(values: torch.Tensor, positions: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    out = torch.zeros(math.prod(shape), dtype=dtype, device=device)
    out.index_put_((positions.to(out.device),), values.to(device=out.device, dtype=dtype))
    return out.view(shape)
