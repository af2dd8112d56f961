"""A model of the swarm at internet scale: samples/s of S stages with R replicas each, their links
drawn from a spread of home and cloud rates and delays, and what limits it first.

One step (the synchronous schedule, `train.schedule: sync`) is:
- the pipeline's micro-batches, replayed by the fluid model over the replicas (swarm.bench.fluid_swarm:
  per-peer links and compute, the routing policy, backward the way forward came), and the step's
  rounds from the trainer to every peer and back;
- then each replicated stage's averaging in its gather round (swarm.transport.hivemind.stage
  .combine: every stage at once), the all-reduce of `allreduce_s`;
- and, with churn, what the departures of the step cost (`churn_s`): the micro-batches a departed
  replica ran this step run again, its in-flight ones are retried once its failure is seen, and a
  stage whose every replica is gone goes back to the swarm's copies. Replicas that left are
  replaced after the join delay (a joiner's start, admission at a step boundary and state download):
  meanwhile the stage runs with fewer (`present`).

Beside the samples/s it gives the samples/s each part alone would allow (`bounds`): the stages'
replicas (their links and compute, summed per stage), the trainer's link, the in-flight window
(micro-batches the trainer may keep out over one micro-batch's round trip, Little's law), and
the averaging (a step's samples over its all-reduce alone); the smallest is what saturates, unless a
hard limit of the code is passed first (`limits`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from swarm.bench.fluid_swarm import Link, Payloads, Replica, Schedule, SwarmStep, simulate_swarm
from swarm.bench.scale_dht import DhtLoad, dht_load
from swarm.engine.exactsum import CHECK_VALUES, MAX_GROUP, MAX_TERMS
from swarm.transport.hivemind.net.settings import Settings

MIB = 2**20
MAX_MEMBERS = 1024  # the trainer's session (swarm.transport.hivemind.trainer.setups.MAX_MEMBERS)
# What one all-reduce takes beyond its bytes and delays, per other member: the runner's part stream
# to each through both p2p daemons, the averager's bookkeeping. Measured in the lab (docs/bench/
# scale.md, "The lab beside the model"): a replicated stage's gather round, two all-reduces of a few
# KB on 10 Mbit/s links without delay, took 0.14 s in groups of 2, 0.26 of 3, 0.31 of 4 (the machine
# busy with other sessions, load 10-24: an idle one would take less).
ALLREDUCE_PEER_S = 0.05


@dataclass(frozen=True)
class Workload:
    """What a sample costs a stage; defaults: one GPT-2-small block per stage (7.1 M parameters,
    12 tensors), sequences of 128 tokens, hidden states [128, 768] in fp32 across every boundary."""

    boundary_bytes: float = 128 * 768 * 4  # per sample, each boundary, forward and backward alike
    input_bytes: float = 128 * 8 * 2  # trainer -> stage 0 per sample: token ids and targets (int64)
    param_bytes: float = 7.1e6 * 4  # per stage (fp32)
    tensors: int = 12  # parameter tensors per stage (the exact sum's check sends two values each)
    samples_per_micro_batch: int = 4


@dataclass(frozen=True)
class Spread:
    """Each peer's link and compute, drawn uniformly (`seed`): home to cloud."""

    rate_mbit: tuple[float, float] = (10.0, 100.0)  # each direction
    delay_ms: tuple[float, float] = (20.0, 150.0)  # one way
    compute_ms: tuple[float, float] = (5.0, 40.0)  # per sample and stage, forward and backward
    seed: int = 0


@dataclass(frozen=True)
class Churn:
    leave_per_hour: float = 0.0  # per peer: departures without notice (preemption, a closed laptop)
    join_s: float = 60.0  # a replacement's start, DHT announce and admission, before its state download
    detect_s: float = 5.0  # until the senders see a departed peer's calls fail and retry elsewhere
    copy_every: int = 10  # steps between the swarm's copies (--snapshot_every): a stage lost goes back


@dataclass(frozen=True)
class ScalePoint:
    stages: int
    replicas: int
    workload: Workload = Workload()
    spread: Spread = Spread()
    churn: Churn = Churn()
    trainer: Link = Link(1e9, 1e9, 0.01)  # a cloud machine
    micro_batches: int = 256  # per step: 1,024 samples of 128 tokens, whatever the swarm's size
    # what one DHT node takes: stores of one key a second (docs/bench/scale.md: measured 30-85 here)
    dht_stores_per_s: float = 100.0


@dataclass
class Prediction:
    samples_per_s: float
    step_s: float
    pipeline_s: float  # the micro-batches and the step's rounds
    averaging_s: float  # the slowest stage's all-reduce
    churn_s: float  # what departures cost a step, on average
    present: float  # replicas per stage on average under churn
    bounds: dict[str, float]  # samples/s each part alone allows
    saturates: str  # the part whose bound is lowest, or a hard limit passed
    limits: list[str] = field(default_factory=list)  # hard limits of the code this point passes
    routed: tuple[int, int] = (0, 0)  # fewest and most micro-batches a replica ran
    dht: DhtLoad | None = None
    pipeline_fraction: float = 1.0  # the micro-batches' samples/s over the lowest bound of the pipeline's parts


def in_flight(stages: int, replicas: int, settings: Settings) -> int:
    """Micro-batches in flight: two per stage peer (the trainer's default is two per stage: a run
    with replicas sets train.in_flight higher), at most what one stage peer takes from one sender
    (max_requests_per_sender, the trainer's cap: swarm.transport.hivemind.trainer.dispatch)."""
    return min(2 * stages * replicas, settings.limits.max_requests_per_sender)


def draw(point: ScalePoint) -> list[list[Replica]]:
    """Every replica's link and compute (seconds per micro-batch, forward or backward), seeded."""
    rng, s = random.Random(point.spread.seed), point.spread
    stages = []
    for _ in range(point.stages):
        replicas = []
        for _ in range(point.replicas):
            up, down = (rng.uniform(*s.rate_mbit) * 1e6 for _ in range(2))
            link = Link(up, down, rng.uniform(*s.delay_ms) / 1000)
            per_sample = rng.uniform(*s.compute_ms) / 1000
            replicas.append(Replica(link, per_sample * point.workload.samples_per_micro_batch / 2))
        stages.append(replicas)
    return stages


def allreduce_s(links: list[Link], nbytes: float) -> float:
    """hivemind's butterfly all-reduce of `nbytes` among members on `links` (equal slices): in each of
    its two phases every member sends and receives (n - 1) / n of the bytes, the slowest link
    finishing last, after the farthest delay; and hivemind's own time for each other member
    (`ALLREDUCE_PEER_S`)."""
    n = len(links)
    if n < 2:
        return 0.0
    slowest = min(min(link.up_bits, link.down_bits) for link in links) / 8
    return (n - 1) * ALLREDUCE_PEER_S + 2 * ((n - 1) / n * nbytes / slowest + max(link.delay_s for link in links))


def averaging_s(links: list[Link], workload: Workload) -> float:
    """A replicated stage's exact sum (swarm.transport.hivemind.stage.replicasum): one all-reduce of
    the gradients as float64 integers on the grid the trainer sent, with a presence flag and the
    grid's check (two values) per tensor."""
    values = workload.param_bytes / 4 * 8 + workload.tensors * (1 + CHECK_VALUES) * 8
    return allreduce_s(links, values)


def present_replicas(replicas: int, churn: Churn) -> float:
    """Replicas of a stage in service on average: each slot empty for the join delay after a
    departure (its state download included in `join_s`)."""
    rate = churn.leave_per_hour / 3600
    return replicas / (1 + rate * churn.join_s)


def churn_s(point: ScalePoint, step_s: float, routed_mean: float, present: float) -> float:
    """Seconds a step loses to departures on average. A departed replica is on the path of about
    half its share of the in-flight micro-batches (those past it await their replies through it):
    they stall until its failure is seen (`detect_s`), then go again from the stage before; the
    micro-batches it ran this step (half its share, on average) run again at the pipeline's pace.
    A stage left without a replica goes back to the copies (a join, then half the copy interval
    replayed)."""
    rate = point.churn.leave_per_hour / 3600
    if rate == 0:
        return 0.0
    departures = rate * point.stages * present * step_s
    stalled = point.churn.detect_s / (2 * present)  # the window's share stalled, times how long
    redo = departures * (stalled + routed_mean / 2 * step_s / point.micro_batches)
    # a stage empties when its last replica leaves while the others are still being replaced
    empty = point.stages * rate * step_s * present * (rate * point.churn.join_s) ** max(round(present) - 1, 0)
    rewind = empty * (point.churn.join_s + point.churn.copy_every / 2 * step_s)
    return redo + rewind


def with_present(stages: list[list[Replica]], present: float) -> list[list[Replica]]:
    """The replicas in service under churn: the first round(present) of each stage (at least one)."""
    keep = max(1, round(present))
    return [replicas[:keep] for replicas in stages]


def bounds(point: ScalePoint, stages: list[list[Replica]], window: int, step: tuple[float, int]) -> dict[str, float]:
    """Samples/s each part alone allows (module doc); `step`: (its averaging seconds, micro-batches)."""
    w, boundary = point.workload, point.workload.boundary_bytes
    per_stage = []
    for s, replicas in enumerate(stages):
        up = boundary * ((s < len(stages) - 1) + (s > 0))  # activations on, gradients back
        down = boundary * ((s > 0) + (s < len(stages) - 1)) + (w.input_bytes if s == 0 else 0.0)
        per_stage.append(
            sum(
                min(
                    r.link.up_bits / 8 / up if up else math.inf,
                    r.link.down_bits / 8 / down if down else math.inf,
                    w.samples_per_micro_batch / (2 * r.compute_s) if r.compute_s else math.inf,
                )
                for r in replicas
            )
        )
    trip = 0.0  # a micro-batch alone through the stages and back: the mean replica of each stage
    for s, replicas in enumerate(stages):
        hops = 2 if s < len(stages) - 1 else 0
        for r in replicas:
            send = hops * boundary * w.samples_per_micro_batch * 8 / r.link.up_bits
            trip += (2 * r.compute_s + send + 2 * r.link.delay_s) / len(replicas)
    trip += w.input_bytes * w.samples_per_micro_batch * 8 / point.trainer.up_bits + 2 * point.trainer.delay_s
    averaging, micro_batches = step
    return {
        "stage replicas": min(per_stage),
        "trainer link": point.trainer.up_bits / 8 / w.input_bytes if w.input_bytes else math.inf,
        "in-flight window": window * w.samples_per_micro_batch / trip,
        "averaging": micro_batches * w.samples_per_micro_batch / averaging if averaging else math.inf,
    }


def hard_limits(point: ScalePoint, settings: Settings, micro_batches: int) -> list[str]:
    """The code's own limits this point passes (it would refuse to run as it is)."""
    limits = []
    if point.replicas > MAX_GROUP:
        limits.append(f"group size: the exact sum takes at most {MAX_GROUP} replicas in a group")
    if point.replicas > settings.limits.max_peers_per_stage:
        limits.append(f"max_peers_per_stage {settings.limits.max_peers_per_stage}")
    if point.stages * point.replicas > MAX_MEMBERS:
        limits.append(f"the trainer's session takes at most {MAX_MEMBERS} members")
    if micro_batches > MAX_TERMS:
        limits.append(f"the exact sum takes at most {MAX_TERMS} micro-batches a step")
    return limits


def predict(point: ScalePoint, settings: Settings | None = None) -> Prediction:
    settings = settings or Settings()
    if point.stages < 2 or point.replicas < 1:
        raise ValueError(f"the model needs at least 2 stages and 1 replica, got {point.stages} x {point.replicas}")
    drawn = draw(point)
    window = in_flight(point.stages, point.replicas, settings)
    micro_batches = point.micro_batches
    present = present_replicas(point.replicas, point.churn)
    stages = with_present(drawn, present)
    result = simulate_swarm(step_for(point, stages, window, settings))
    averaging = max(averaging_s([r.link for r in replicas], point.workload) for replicas in stages)
    step_s = result.step_s + averaging
    routed = sorted(result.routed.values())
    lost = churn_s(point, step_s, sum(routed) / len(routed), present)
    samples = micro_batches * point.workload.samples_per_micro_batch
    allowed = bounds(point, stages, window, (averaging, micro_batches))
    limits = hard_limits(point, settings, micro_batches)
    joins = point.churn.leave_per_hour / 3600 * present * step_s
    if joins > settings.limits.joins_per_step:
        limits.append(f"joins_per_step {settings.limits.joins_per_step}: {joins:.1f} replicas a stage leave a step")
    dht = dht_load(point.stages, point.replicas, step_s)
    if dht.hottest_stores_per_s > point.dht_stores_per_s:
        limits.append(f"DHT: {dht.hottest_stores_per_s:.0f} stores/s of the run listing on its nodes")
    fraction = samples / result.step_s / min(v for k, v in allowed.items() if k != "averaging")
    return Prediction(
        samples / (step_s + lost),
        step_s + lost,
        result.step_s,
        averaging,
        lost,
        present,
        allowed,
        saturation(limits, allowed, fraction, (averaging, result.step_s, lost)),
        limits,
        (routed[0], routed[-1]),
        dht,
        fraction,
    )


def saturation(limits: list[str], allowed: dict[str, float], fraction: float, seconds: tuple[float, ...]) -> str:
    """What limits a point first: a hard limit it passes; else churn when departures cost more than
    the step itself; else the averaging when it takes longer than the pipeline (`seconds`:
    averaging, pipeline, churn); else the pipeline's lowest bound, or the stragglers when the
    pipeline reaches less than half of it (its slowest replicas and paths: a replica's backward
    waits for its forward order, routing follows compute, not links)."""
    averaging, pipeline, lost = seconds
    if limits:
        return limits[0].split(":")[0]
    if lost > averaging + pipeline:
        return "churn"
    if averaging >= pipeline:
        return "averaging"
    if fraction < 0.5:
        return "stragglers"
    return min((k for k in allowed if k != "averaging"), key=allowed.get)


def step_for(point: ScalePoint, stages: list[list[Replica]], window: int, settings: Settings) -> SwarmStep:
    """The fluid model's step of a point (micro-batches of `samples_per_micro_batch` samples)."""
    w = point.workload
    per_mb = w.boundary_bytes * w.samples_per_micro_batch
    return SwarmStep(
        stages=stages,
        payloads=Payloads(
            [per_mb] * (point.stages - 1), [per_mb] * (point.stages - 1), w.input_bytes * w.samples_per_micro_batch
        ),
        # the step's rounds: gather (where replicas average), set_grads (clipping's norm), apply
        schedule=Schedule(point.micro_batches, window, settings.streams.sending_per_neighbour, 3),
        trainer=point.trainer,
    )
