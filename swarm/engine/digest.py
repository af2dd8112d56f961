"""What a swarm's verification (`train.verify`) compares between two peers that ran one micro-batch:
a digest of the gradients a stage holds for it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def gradient_digest(held: Sequence[tuple[str, torch.Tensor]], exact: bool = True) -> float:
    """A hash of the bits of `held` (name, gradient) pairs (`exact`: 52 bits, a float64 integer: the
    sums are exact, so equal runs give equal bits), else their squared norm in float64, for a
    tolerance (a model whose kernels are not deterministic); 0 for nothing held."""
    if not exact:
        return sum(float(g.detach().double().pow(2).sum()) for _, g in held)
    digest = hashlib.sha256()
    for name, g in held:
        digest.update(name.encode())
        digest.update(g.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return float(int.from_bytes(digest.digest()[:8], "big") >> 12)
