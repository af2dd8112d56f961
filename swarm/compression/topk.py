"""TopK selection math: per sample, over the flattened sample, by absolute value.

Exactly ceil(K * n) values are kept per sample. The selection is a sorted vector of flat
positions into the whole tensor: values are read with index_select and written back with
index_put, and the wire codes the positions.

Selection is exact but cheaper than torch.topk over the whole row: a strided sample of every row
gives a threshold that leaves a little more than K * n candidates, and torch.topk runs on those
candidates only. Every value in the true top-k is at least the threshold whenever a row has k
candidates, so the result is a valid top-k; rows without enough candidates (or with too many,
e.g. mostly zeros) take plain torch.topk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from protocols.wire import rows_of

_SAMPLE_PER_ROW = 4096  # strided sample used to place the candidate threshold
_CANDIDATE_SLACK = 1.3  # aim for 30% more candidates than kept values (plus sampling noise)


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


def _candidates(magnitude: torch.Tensor, k: int) -> torch.Tensor | None:
    """Top-k positions via a sampled threshold, or None when the shortcut does not apply."""
    rows, n = magnitude.shape
    stride = n // _SAMPLE_PER_ROW
    while stride > 1 and math.gcd(stride, 210) != 1:  # coprime to 2, 3, 5, 7: no aliasing with channel widths
        stride -= 1
    if stride < 4:
        return None
    sample = magnitude[:, ::stride]
    size = sample.shape[1]
    expected = size * k / n
    wanted = min(size, math.ceil(expected * _CANDIDATE_SLACK + 4 * math.sqrt(expected) + 8))
    threshold = torch.kthvalue(sample, size - wanted + 1, dim=1).values
    positions = (magnitude >= threshold[:, None]).view(-1).nonzero().squeeze(1)
    row = torch.div(positions, n, rounding_mode="floor")
    counts = torch.bincount(row, minlength=rows)
    widest = int(counts.max())
    if int(counts.min()) < k or widest > n // 2:
        return None
    starts = counts.cumsum(0) - counts
    column = torch.arange(positions.numel(), device=positions.device) - starts[row]
    padded = torch.full((rows, widest), -1.0, dtype=magnitude.dtype, device=magnitude.device)
    padded[row, column] = magnitude.view(-1)[positions]
    top = torch.topk(padded, k, dim=1, sorted=False).indices
    chosen = torch.zeros((rows, widest), dtype=torch.bool, device=magnitude.device)
    chosen.scatter_(1, top, True)
    return positions[chosen[row, column]]


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
    positions = _candidates(magnitude, k)
    return (_exact(magnitude, k) if positions is None else positions), k


def gather(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).index_select(0, positions.to(x.device))


def scatter(values: torch.Tensor, positions: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    out = torch.zeros(math.prod(shape), dtype=dtype, device=device)
    out.index_put_((positions.to(out.device),), values.to(device=out.device, dtype=dtype))
    return out.view(shape)
