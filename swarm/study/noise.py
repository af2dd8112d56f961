"""A comparison of two measured rows against their spread over seeds.

A difference counts only when it is outside the noise, and the noise of a difference is 2 x the
pooled standard deviation of the two rows over their seeds (for a row's own compressed minus
uncompressed inference: 2 x the standard deviation of the per-seed differences). With 3 seeds a
side, a difference at that noise is t = 2.45 (4 degrees of freedom), two-sided p = 0.07. A row with
one seed has no spread: a comparison of it is not judged, and leans on the fixed guess of earlier
single-seed studies instead (`GUESS`: 2 accuracy points, 0.1 nats).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

GUESS = {"acc": 2.0, "loss": 0.1}  # single-seed stand-ins for the noise, by metric kind


@dataclass
class Diff:
    value: float  # difference of the means
    noise: float | None  # None: a side has one seed
    guess: float  # the stand-in noise when it is None
    seeds: tuple[int, int]

    def sign(self, threshold: float = 0.0) -> int:
        """+1: the difference is above `threshold` by more than the noise; -1: below it by more; 0: within noise."""
        noise = self.guess if self.noise is None else self.noise
        if self.value - threshold > noise:
            return 1
        if self.value - threshold < -noise:
            return -1
        return 0

    def text(self, unit: str = "") -> str:
        noise = "single seed" if self.noise is None else f"noise ±{self.noise:.2f}"
        n = f"n {self.seeds[0]}" if self.seeds[0] == self.seeds[1] else f"n {self.seeds[0]}/{self.seeds[1]}"
        return f"{self.value:+.2f}{unit} ({noise}, {n})"


def _pooled(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    sa, sb = statistics.variance(a), statistics.variance(b)
    return math.sqrt(((len(a) - 1) * sa + (len(b) - 1) * sb) / (len(a) + len(b) - 2))


def unpaired(a: list[float], b: list[float], kind: str = "acc") -> Diff:
    """mean(a) - mean(b) for two rows' per-seed values."""
    pooled = _pooled(a, b)
    value = statistics.fmean(a) - statistics.fmean(b)
    return Diff(value, None if pooled is None else 2 * pooled, GUESS[kind], (len(a), len(b)))


def paired(a: list[float], b: list[float], kind: str = "acc") -> Diff:
    """mean(a - b) for two measurements of the same runs (seed by seed)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    noise = 2 * statistics.stdev(diffs) if len(diffs) >= 2 else None
    return Diff(statistics.fmean(diffs), noise, GUESS[kind], (len(a), len(b)))


def combine(signs: list[int]) -> str:
    """A finding's verdict from its comparisons (+1 agrees with the paper, -1 contradicts, 0 within noise)."""
    if signs and all(s == 1 for s in signs):
        return "holds"
    if signs and all(s == -1 for s in signs):
        return "does not hold"
    if 1 in signs and -1 in signs:
        return "mixed"
    return "within noise"


def judged(verdict: str, diffs: list[Diff]) -> str:
    """The verdict, or "not judged" when a comparison had a single-seed side (with the lean)."""
    if any(d.noise is None for d in diffs):
        return f"not judged: single seed ({verdict} with the fixed guess)"
    return verdict
