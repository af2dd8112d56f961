"""Adaptive compression: per boundary, the mildest codec whose link time fits the compute time.

Each pipeline boundary has candidate settings ordered from mildest (best accuracy, most bytes) to
strongest (fewest bytes), e.g. none, topk:0.5, topk:0.3, topk:0.2, topk:0.1, topk:0.05 or
quant:8 .. quant:2, each with its wire bytes per sample (measured, or from a bytes model). Given a
boundary's bandwidth and a target link time per sample (typically the compute time per sample of
the slower neighbouring stage, so the link never becomes the bottleneck), the choice is the
mildest candidate whose link time <= target; if none fits, the strongest.

When the bandwidth changes the choice is made again, with hysteresis so that a bandwidth hovering
near a threshold does not flap: the controller moves to a stronger setting as soon as the current
one no longer fits (the link would throttle the pipeline), but back to a milder one only when
that one fits with `hysteresis` to spare (link time <= (1 - hysteresis) * target).

Link time per sample of a candidate at B bits/s: full duplex (the default) is
max(forward, backward) * 8 / B, `shared=True` (both directions on one medium) is
(forward + backward) * 8 / B. A
bandwidth may also be a (forward, backward) pair of bits/s, for links measured per direction:
then each direction's bytes go at its own rate (max, or sum when shared, of the two times).

API (pure: no network, no clocks)
    Candidate(spec, forward_bytes, backward_bytes=None)      .link_seconds(bandwidth, shared=False)
        bandwidth: bits/s, or (forward, backward) bits/s wherever a bandwidth is taken
    topk_candidates(elements, ratios=(1.0, 0.5, 0.3, 0.2, 0.1, 0.05), value_bytes=4, reuse_backward=True)
    quant_candidates(elements, bits=(8, 7, 6, 5, 4, 3, 2), groups=1, include_none=True)
    neighbour_targets(stage_seconds) -> {boundary j: max(stage j, stage j+1) seconds per sample}
    choose(candidates, bandwidth_bits, target_seconds, shared=False, margin=0.0) -> index
    AdaptiveCompression(candidates_by_boundary, hysteresis=0.15, shared=False)
        .decide(bandwidth_bits, target_seconds) -> {boundary: Decision}
        .choices -> {boundary: spec}   .history -> [Decision] (every change)   .report() -> str
    Decision(boundary, spec, index, link_seconds, target_seconds, bandwidth_bits, fits, changed, reason)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.rates import format_rate

Bandwidth = float | tuple[float, float]  # bits/s, or (forward, backward) bits/s


@dataclass(frozen=True)
class Candidate:
    """One codec setting and the wire bytes per sample it puts on the boundary's link."""

    spec: str  # a compression spec (swarm.compression.spec), e.g. "topk:0.1" or "quant:4"
    forward_bytes: float
    backward_bytes: float | None = None  # None: the same as forward

    def link_seconds(self, bandwidth_bits: Bandwidth, shared: bool = False) -> float:
        fw = self.forward_bytes
        bw = fw if self.backward_bytes is None else self.backward_bytes
        if isinstance(bandwidth_bits, tuple):  # per direction
            times = [_seconds(nbytes, rate) for nbytes, rate in zip((fw, bw), bandwidth_bits, strict=True)]
            return sum(times) if shared else max(times)
        return _seconds(fw + bw if shared else max(fw, bw), bandwidth_bits)


def _seconds(nbytes: float, bandwidth_bits: float) -> float:
    if nbytes <= 0:
        return 0.0
    return nbytes * 8 / bandwidth_bits if bandwidth_bits > 0 else math.inf


def _rate(bandwidth_bits: Bandwidth) -> str:
    if isinstance(bandwidth_bits, tuple):
        fw, bw = bandwidth_bits
        return _rate(fw) if fw == bw else f"{_rate(fw)} forward, {_rate(bw)} backward"
    return format_rate(bandwidth_bits) if math.isfinite(bandwidth_bits) else "unmeasured bandwidth"


def topk_candidates(
    elements: int,
    ratios: Sequence[float] = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05),
    value_bytes: float = 4,
    reuse_backward: bool = True,
) -> list[Candidate]:
    """A bytes model for TopK (ratio 1.0 is no compression, spec 'none').

    Forward: kept values plus the cheaper index coding of protocols.indices (a bitmap, n/8 bytes,
    or ~1 byte of gap varint per kept value). Backward with `reuse_backward` (topk:reuse): the
    values only, at the forward's positions. Measured bytes beat this model: prefer them.
    """
    out = []
    for ratio in ratios:
        if not 0 < ratio <= 1:
            raise ValueError(f"bad TopK ratio {ratio}: must be in (0, 1]")
        if ratio == 1.0:
            out.append(Candidate("none", elements * 4.0))
            continue
        kept = math.ceil(ratio * elements)
        values = kept * value_bytes
        indices = min(elements / 8, kept * 1.0)
        out.append(Candidate(f"topk:{ratio:g}", values + indices, values if reuse_backward else values + indices))
    return out


def quant_candidates(
    elements: int, bits: Sequence[int] = (8, 7, 6, 5, 4, 3, 2), groups: int = 1, include_none: bool = True
) -> list[Candidate]:
    """A bytes model for k-bit quantization: packed codes plus an fp32 min and scale per group."""
    out = [Candidate("none", elements * 4.0)] if include_none else []
    for b in bits:
        if not 1 <= b <= 8:
            raise ValueError(f"bad bit width {b}: 1..8")
        out.append(Candidate(f"quant:{b}", math.ceil(elements * b / 8) + 8 * groups))
    return out


def neighbour_targets(stage_seconds: Sequence[float]) -> dict[int, float]:
    """Target link time per boundary: the compute time per sample of the slower neighbour."""
    return {j: max(stage_seconds[j], stage_seconds[j + 1]) for j in range(len(stage_seconds) - 1)}


def choose(
    candidates: Sequence[Candidate],
    bandwidth_bits: Bandwidth,
    target_seconds: float,
    shared: bool = False,
    margin: float = 0.0,
) -> int:
    """Index of the mildest candidate with link time <= (1 - margin) * target; else the strongest."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    for i, candidate in enumerate(candidates):
        if candidate.link_seconds(bandwidth_bits, shared) <= (1 - margin) * target_seconds:
            return i
    return len(candidates) - 1


@dataclass(frozen=True)
class Decision:
    boundary: Hashable
    spec: str
    index: int  # into the boundary's candidates (0 = mildest)
    link_seconds: float  # per sample at the bandwidth
    target_seconds: float
    bandwidth_bits: Bandwidth
    fits: bool  # link_seconds <= target_seconds
    changed: bool
    reason: str

    def describe(self) -> str:
        return (
            f"boundary {self.boundary}: {self.spec} ({self.link_seconds * 1e3:.3g} ms/sample at {_rate(self.bandwidth_bits)}, "
            f"target {self.target_seconds * 1e3:.3g} ms){'' if self.fits else ' DOES NOT FIT'}; {self.reason}"
        )


@dataclass
class AdaptiveCompression:
    """Per-boundary choices that follow the bandwidth, with hysteresis (see module docstring)."""

    candidates: Mapping[Hashable, Sequence[Candidate]]
    hysteresis: float = 0.15
    shared: bool = False
    current: dict[Hashable, int] = field(default_factory=dict)
    history: list[Decision] = field(default_factory=list)
    last: dict[Hashable, Decision] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"bad hysteresis {self.hysteresis}: in [0, 1)")
        for boundary, options in self.candidates.items():
            if not options:
                raise ValueError(f"boundary {boundary} has no candidates")
            sizes = [
                max(c.forward_bytes, c.backward_bytes if c.backward_bytes is not None else c.forward_bytes)
                for c in options
            ]
            if any(b > a for a, b in zip(sizes, sizes[1:], strict=False)):
                raise ValueError(
                    f"boundary {boundary}: candidates must go from mildest (most bytes) to strongest, got {[c.spec for c in options]}"
                )

    @staticmethod
    def _per(value, boundary: Hashable, what: str):
        if isinstance(value, Mapping):
            if boundary not in value:
                raise ValueError(f"no {what} for boundary {boundary}")
            value = value[boundary]
        return tuple(float(v) for v in value) if isinstance(value, tuple) else float(value)

    def decide(
        self, bandwidth_bits: Bandwidth | Mapping[Hashable, Bandwidth], target_seconds: float | Mapping[Hashable, float]
    ) -> dict[Hashable, Decision]:
        """Re-decides every boundary for the given bandwidth(s) and target(s); records changes."""
        decisions = {}
        for boundary, options in self.candidates.items():
            bandwidth = self._per(bandwidth_bits, boundary, "bandwidth")
            target = self._per(target_seconds, boundary, "target")
            ideal = choose(options, bandwidth, target, self.shared)
            now = self.current.get(boundary)
            if now is None:
                pick, reason = ideal, "first choice"
            elif ideal > now:
                pick, reason = ideal, f"{options[now].spec} no longer fits"
            elif ideal < now:
                relaxed = choose(options, bandwidth, target, self.shared, margin=self.hysteresis)
                if relaxed < now:
                    pick, reason = relaxed, f"{options[relaxed].spec} fits with {self.hysteresis:.0%} to spare"
                else:
                    pick, reason = (
                        now,
                        f"kept: {options[ideal].spec} would fit, but not with {self.hysteresis:.0%} to spare",
                    )
            else:
                pick, reason = now, "kept"
            seconds = options[pick].link_seconds(bandwidth, self.shared)
            decision = Decision(
                boundary, options[pick].spec, pick, seconds, target, bandwidth, seconds <= target, pick != now, reason
            )
            self.current[boundary] = pick
            self.last[boundary] = decision
            if decision.changed:
                self.history.append(decision)
            decisions[boundary] = decision
        return decisions

    @property
    def choices(self) -> dict[Hashable, str]:
        return {b: self.candidates[b][i].spec for b, i in self.current.items()}

    def report(self) -> str:
        if not self.last:
            return "adaptive compression: no decision yet"
        lines = ["adaptive compression:"] + [f"  {d.describe()}" for d in self.last.values()]
        if self.history:
            lines.append(
                f"  {len(self.history)} change(s): " + ", ".join(f"{d.boundary}->{d.spec}" for d in self.history)
            )
        return "\n".join(lines)
