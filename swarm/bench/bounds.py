"""Throughput bounds: no schedule beats the busiest link or the slowest stage (pure arithmetic).

A "sample" is one training example going forward through every stage and backward again. Every
benchmark reports achieved samples/s as a fraction of min(link bound, compute bound).

Link bound. A link direction of B bits/s that must carry W wire bytes per sample cannot carry
more than B / 8 / W samples/s. Every lab process has its own shaped access link (in the namespace
lab, its veth to the bridge): process p's up link carries
everything p sends, its down link everything it receives, each direction at the link's rate (tc
shapes each egress: full duplex). A middle stage i sends activations to i+1 *and* gradients to
i-1 on the same up link, so up(i) = fw(i) + bw(i-1) and down(i) = fw(i-1) + bw(i): even with full
duplex, forward and backward bytes share a direction there. `access_loads()` sums a traffic
matrix per process.

The rate is the nominal link rate (what tc enforces). The payload rate over a hivemind stream is
lower (TCP/IP and libp2p framing take their share); to bound against a probe-measured payload
rate instead, pass that rate and payload bytes.

Compute bound. In a pipeline the slowest stage sets the pace: 1 / max(seconds per sample).
When the stages share a machine's cores (the lab: every process on one machine), the cores must
also do all stages' compute: cores / sum(CPU seconds per sample); the compute bound is the lower.

API (all pure)
    compute_bound(stage_seconds_per_sample) -> samples/s
    shared_cores_bound(cores, stage_cpu_seconds_per_sample) -> samples/s
    fraction_of_bound(achieved, link_bound, compute_bound=None) -> float
    chain_transfers(forward_bytes, backward_bytes, names=None, input_bytes=0.0, trainer="trainer") -> [Transfer]
    access_loads(transfers) -> {process: Load(up, down)}
    access_bound(rates, transfers) -> (samples/s, process, "up"|"down")
    pipeline_bound(rates, forward_bytes, backward_bytes, stage_seconds=None, names=None, input_bytes=0.0) -> Bound
    Bound: .link .compute .busiest .direction .wire_bytes
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.rates import parse_rate

RateLike = str | int | float


def _rate(value: RateLike) -> float:
    return float(parse_rate(value)) if isinstance(value, str) else float(value)


def compute_bound(stage_seconds_per_sample: Sequence[float]) -> float:
    """Samples/s of a pipeline whose slowest stage spends max(seconds) per sample (forward+backward)."""
    seconds = list(stage_seconds_per_sample)
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
    trainer: str = "trainer",
) -> list[Transfer]:
    """The traffic of a pipeline: boundary j carries fw[j] from stage j to j+1 and bw[j] back.

    `names` defaults to stage0..stageS-1 (S = boundaries + 1). `input_bytes` adds the trainer's
    sends to stage 0 (the inputs), when it is a peer on a shaped link too.
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
    rates: RateLike | Mapping[str, RateLike | None], transfers: Sequence[Transfer]
) -> tuple[float, str | None, str | None]:
    """(samples/s, busiest process, its busiest direction) for per-process access links.

    `rates`: one rate for every process, or {process: rate}; a missing or None rate is unshaped.
    """
    best: tuple[float, str | None, str | None] = (math.inf, None, None)
    for process, load in access_loads(transfers).items():
        rate = rates.get(process) if isinstance(rates, Mapping) else rates
        if rate is None:
            continue
        for direction, wire in (("up", load.up), ("down", load.down)):
            if wire > 0 and (bound := _rate(rate) / 8 / wire) < best[0]:
                best = (bound, process, direction)
    return best


@dataclass(frozen=True)
class Bound:
    """A run's throughput bound and what sets it."""

    link: float  # samples/s
    compute: float  # samples/s (inf when stage times are unknown)
    busiest: str | None  # the process whose link limits the link bound
    direction: str | None  # its direction that does: "up" or "down"
    wire_bytes: float  # bytes per sample on that link direction


def pipeline_bound(
    rates: RateLike | Mapping[str, RateLike | None],
    forward_bytes: Sequence[float],
    backward_bytes: Sequence[float],
    stage_seconds: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    input_bytes: float = 0.0,
) -> Bound:
    """The bound of an S-stage pipeline with S-1 boundaries of fw[j]/bw[j] wire bytes per sample,
    every process on its own access link: `rates` is one rate or {process: rate} (names default to
    stage0..; `input_bytes` adds the trainer's traffic)."""
    compute = compute_bound(stage_seconds) if stage_seconds else math.inf
    transfers = chain_transfers(forward_bytes, backward_bytes, names, input_bytes)
    bound, process, direction = access_bound(rates, transfers)
    if process is None:
        return Bound(math.inf, compute, None, None, 0.0)
    return Bound(bound, compute, process, direction, getattr(access_loads(transfers)[process], direction))
