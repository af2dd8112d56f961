"""Throughput bounds: no schedule beats the busiest link or the slowest stage (pure arithmetic).

A "sample" is one training example going forward through every stage and backward again. Every
benchmark reports achieved samples/s as a fraction of min(link bound, compute bound).

Link bound. A link direction of B bits/s that must carry W wire bytes per sample cannot carry
more than B / 8 / W samples/s. Which bytes share a rate depends on the shaping:

- Point-to-point boundary (topology="boundary"): stage j and j+1 talk over one link; activations
  go forward one way, gradients backward the other. A tc qdisc on each direction's egress (what
  NetLab and the Docker entrypoint install) gives each direction its own B: full duplex, so
  W = max(forward, backward). `shared=True` is for one budget for both directions (a half-duplex
  radio, or one in-process TokenBucket per link): W = forward + backward.
- Access links (topology="access", the namespace lab: every process has its own shaped link to
  a bridge). Process p's up link carries everything p sends, its down link everything it
  receives. A middle stage i sends activations to i+1 *and* gradients to i-1 on the same up link,
  so up(i) = fw(i) + bw(i-1) and down(i) = fw(i-1) + bw(i): even with full duplex, forward and
  backward bytes *do* share a direction there. `access_loads()` sums a traffic matrix per
  process; `shared=True` additionally merges up and down (a half-duplex access link).

The rate is the nominal link rate (what tc enforces). Payload rates are lower (TCP/IP and
libp2p framing: ~95% of a tbf rate arrives as payload over a hivemind stream); to bound against
a probe-measured payload rate instead, pass that rate and payload bytes.

Compute bound. In a pipeline the slowest stage sets the pace: 1 / max(seconds per sample).
When the stages share a machine's cores (the lab: every process on one machine), the cores must
also do all stages' compute: cores / sum(CPU seconds per sample); the compute bound is the lower.

API (all pure)
    link_bound(rate_bits, forward_bytes, backward_bytes=0.0, shared=False) -> samples/s
    compute_bound(stage_seconds_per_sample) -> samples/s
    shared_cores_bound(cores, stage_cpu_seconds_per_sample) -> samples/s
    fraction_of_bound(achieved, link_bound, compute_bound=None) -> float
    chain_transfers(forward_bytes, backward_bytes, names=None, input_bytes=0.0, label_bytes=0.0, trainer="trainer") -> [Transfer]
    access_loads(transfers) -> {process: Load(up, down)}
    access_bound(rates, transfers, shared=False) -> (samples/s, process, "up"|"down"|"both")
    pipeline_bound(rates, forward_bytes, backward_bytes, stage_seconds=None, topology="boundary",
                   shared=False, names=None, input_bytes=0.0, label_bytes=0.0) -> Bound
    Bound: .link .compute .limit .binding .busiest .direction .wire_bytes .fraction(achieved) .describe() .to_dict()
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from swarm.netlab.rates import format_rate, parse_rate

RateLike = str | int | float


def _rate(value: RateLike) -> float:
    return float(parse_rate(value)) if isinstance(value, str) else float(value)


def link_bound(rate_bits: RateLike, forward_bytes: float, backward_bytes: float = 0.0, shared: bool = False) -> float:
    """Samples/s one link can carry: rate/8 over the bytes per sample of its busiest direction.

    `forward_bytes` and `backward_bytes` cross the link per sample in opposite directions; full
    duplex (default) bounds by max(fw, bw), `shared=True` by fw + bw. No bytes -> infinity.
    """
    if forward_bytes < 0 or backward_bytes < 0:
        raise ValueError(f"bytes per sample must be >= 0, got forward {forward_bytes}, backward {backward_bytes}")
    wire = forward_bytes + backward_bytes if shared else max(forward_bytes, backward_bytes)
    return math.inf if wire == 0 else _rate(rate_bits) / 8 / wire


def compute_bound(stage_seconds_per_sample: Sequence[float] | float) -> float:
    """Samples/s of a pipeline whose slowest stage spends max(seconds) per sample (forward+backward)."""
    seconds = (
        [stage_seconds_per_sample]
        if isinstance(stage_seconds_per_sample, int | float)
        else list(stage_seconds_per_sample)
    )
    if not seconds:
        raise ValueError("compute_bound needs at least one stage time")
    if any(s < 0 for s in seconds):
        raise ValueError(f"stage seconds per sample must be >= 0, got {seconds}")
    slowest = max(seconds)
    return math.inf if slowest == 0 else 1.0 / slowest


def shared_cores_bound(cores: float, stage_cpu_seconds_per_sample: Sequence[float]) -> float:
    """Samples/s that `cores` cores can compute when every stage runs on them: cores / sum(CPU seconds)."""
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    seconds = list(stage_cpu_seconds_per_sample)
    if any(s < 0 for s in seconds):
        raise ValueError(f"stage CPU seconds per sample must be >= 0, got {seconds}")
    total = sum(seconds)
    return math.inf if total == 0 else cores / total


def fraction_of_bound(achieved: float, link_bound: float, compute_bound: float | None = None) -> float:
    """achieved / min(link bound, compute bound): 1.0 means the schedule loses nothing (nan: no bound)."""
    limit = min(link_bound, compute_bound if compute_bound is not None else math.inf)
    if limit <= 0:
        raise ValueError(f"the bound must be positive, got {limit}")
    return math.nan if math.isinf(limit) else achieved / limit


@dataclass(frozen=True)
class Transfer:
    """`bytes_per_sample` wire bytes that `src` sends to `dst` for every sample."""

    src: str
    dst: str
    bytes_per_sample: float


@dataclass(frozen=True)
class Load:
    up: float  # bytes per sample the process sends
    down: float  # bytes per sample it receives


def chain_transfers(
    forward_bytes: Sequence[float],
    backward_bytes: Sequence[float],
    names: Sequence[str] | None = None,
    input_bytes: float = 0.0,
    label_bytes: float = 0.0,
    trainer: str = "trainer",
) -> list[Transfer]:
    """The traffic of a pipeline: boundary j carries fw[j] from stage j to j+1 and bw[j] back.

    `names` defaults to stage0..stageS-1 (S = boundaries + 1). `input_bytes` (trainer -> stage 0)
    and `label_bytes` (trainer -> last stage) add the trainer's sends when it is a peer too.
    """
    if len(forward_bytes) != len(backward_bytes):
        raise ValueError(f"{len(forward_bytes)} forward but {len(backward_bytes)} backward boundaries")
    stages = len(forward_bytes) + 1
    names = list(names) if names is not None else [f"stage{i}" for i in range(stages)]
    if len(names) != stages:
        raise ValueError(f"{len(forward_bytes)} boundaries need {stages} stage names, got {len(names)}")
    transfers = []
    for j, (fw, bw) in enumerate(zip(forward_bytes, backward_bytes, strict=True)):
        transfers += [Transfer(names[j], names[j + 1], fw), Transfer(names[j + 1], names[j], bw)]
    if input_bytes:
        transfers.append(Transfer(trainer, names[0], input_bytes))
    if label_bytes:
        transfers.append(Transfer(trainer, names[-1], label_bytes))
    return transfers


def access_loads(transfers: Sequence[Transfer]) -> dict[str, Load]:
    """Per process: bytes per sample on its up link (sends) and down link (receives)."""
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for t in transfers:
        if t.bytes_per_sample < 0:
            raise ValueError(f"negative bytes per sample on {t.src} -> {t.dst}")
        up[t.src] = up.get(t.src, 0.0) + t.bytes_per_sample
        down[t.dst] = down.get(t.dst, 0.0) + t.bytes_per_sample
    return {p: Load(up.get(p, 0.0), down.get(p, 0.0)) for p in sorted(set(up) | set(down))}


def access_bound(
    rates: RateLike | Mapping[str, RateLike | None], transfers: Sequence[Transfer], shared: bool = False
) -> tuple[float, str | None, str | None]:
    """(samples/s, busiest process, its busiest direction) for per-process access links.

    `rates`: one rate for every process, or {process: rate}; a missing or None rate is unshaped.
    """
    best: tuple[float, str | None, str | None] = (math.inf, None, None)
    for process, load in access_loads(transfers).items():
        rate = rates.get(process) if isinstance(rates, Mapping) else rates
        if rate is None:
            continue
        directions = [("both", load.up + load.down)] if shared else [("up", load.up), ("down", load.down)]
        for direction, wire in directions:
            if wire > 0 and (bound := _rate(rate) / 8 / wire) < best[0]:
                best = (bound, process, direction)
    return best


@dataclass(frozen=True)
class Bound:
    """A run's throughput bound and what sets it."""

    link: float  # samples/s
    compute: float  # samples/s (inf when stage times are unknown)
    busiest: str | None  # the boundary index ("0", "1", ...) or process name that limits the link bound
    direction: str | None  # "max(fw,bw)", "fw+bw", "up", "down", "both"
    wire_bytes: float  # bytes per sample on the busiest link direction
    rate_bits: float | None  # that link's rate

    @property
    def limit(self) -> float:
        return min(self.link, self.compute)

    @property
    def binding(self) -> str:
        return "link" if self.link <= self.compute else "compute"

    def fraction(self, achieved: float) -> float:
        return fraction_of_bound(achieved, self.link, self.compute)

    def describe(self, achieved: float | None = None) -> str:
        link = "unbounded" if math.isinf(self.link) else f"{self.link:.3g} samples/s"
        text = f"link bound {link}"
        if self.busiest is not None and self.rate_bits:
            text += (
                f" ({self.busiest} {self.direction}: {self.wire_bytes:.4g} B/sample at {format_rate(self.rate_bits)})"
            )
        if not math.isinf(self.compute):
            text += f", compute bound {self.compute:.3g} samples/s"
        text += f"; {self.binding}-bound"
        if achieved is not None and not math.isinf(self.limit):
            text += f"; achieved {achieved:.3g} samples/s = {self.fraction(achieved):.0%} of the bound"
        return text

    def to_dict(self) -> dict:
        return {**asdict(self), "limit": self.limit, "binding": self.binding}


def pipeline_bound(
    rates: RateLike | Sequence[RateLike] | Mapping[str, RateLike | None],
    forward_bytes: Sequence[float],
    backward_bytes: Sequence[float],
    stage_seconds: Sequence[float] | None = None,
    topology: str = "boundary",
    shared: bool = False,
    names: Sequence[str] | None = None,
    input_bytes: float = 0.0,
    label_bytes: float = 0.0,
) -> Bound:
    """The bound of an S-stage pipeline with S-1 boundaries of fw[j]/bw[j] wire bytes per sample.

    topology="boundary": `rates` is one rate or one per boundary; each boundary is its own link.
    topology="access": `rates` is one rate or {process: rate} for the namespace lab's per-process
    links (names default to stage0..; input/label bytes add the trainer's traffic).
    """
    compute = compute_bound(stage_seconds) if stage_seconds else math.inf
    if topology == "boundary":
        count = len(forward_bytes)
        if len(backward_bytes) != count:
            raise ValueError(f"{count} forward but {len(backward_bytes)} backward boundaries")
        if isinstance(rates, Mapping):
            raise ValueError("topology='boundary' takes one rate or a list with one rate per boundary")
        per = [rates] * count if isinstance(rates, str | int | float) else list(rates)
        if len(per) != count:
            raise ValueError(f"{count} boundaries but {len(per)} rates")
        best = Bound(math.inf, compute, None, None, 0.0, None)
        for j, (rate, fw, bw) in enumerate(zip(per, forward_bytes, backward_bytes, strict=True)):
            bound = link_bound(rate, fw, bw, shared)
            if bound < best.link:
                best = Bound(
                    bound,
                    compute,
                    str(j),
                    "fw+bw" if shared else "max(fw,bw)",
                    fw + bw if shared else max(fw, bw),
                    _rate(rate),
                )
        return best
    if topology == "access":
        if isinstance(rates, Sequence) and not isinstance(rates, str):
            raise ValueError("topology='access' takes one rate or {process: rate}")
        transfers = chain_transfers(forward_bytes, backward_bytes, names, input_bytes, label_bytes)
        bound, process, direction = access_bound(rates, transfers, shared)
        if process is None:
            return Bound(math.inf, compute, None, None, 0.0, None)
        load = access_loads(transfers)[process]
        wire = load.up + load.down if direction == "both" else getattr(load, direction)
        rate = rates.get(process) if isinstance(rates, Mapping) else rates
        return Bound(bound, compute, process, direction, wire, _rate(rate))
    raise ValueError(f"bad topology {topology!r}: 'boundary' or 'access'")
