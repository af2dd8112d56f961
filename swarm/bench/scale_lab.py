"""The scale model's prediction for a lab row (docs/bench/scale.json, kind "lab"): the lab's swarm,
every process on its own shaped link of one rate and delay, the stages' compute as measured.

    setup = LabSetup(stages=8, replicas=4, bandwidth_mbit=100, delay_ms=0,
                     stage_ms_per_sample=[...],      # measured, forward and backward, per stage
                     traffic=LabTraffic(forward_bytes=[...], backward_bytes=[...], param_bytes=[...]),
                     train=LabTrain(batch_size=128, micro_batches=32))
    lab_samples_per_s(setup)     # what the model predicts: the row's model_samples_per_s
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarm.bench.fluid_swarm import Link, Payloads, Replica, Schedule, SwarmStep, simulate_swarm
from swarm.bench.scale_model import Workload, averaging_s
from swarm.transport.hivemind.net.settings import Settings


@dataclass(frozen=True)
class LabTraffic:
    """Bytes per sample, as a throughput row measures them (payload per boundary), and each
    stage's parameters (fp32 bytes) and parameter tensors, which its replicas' all-reduce sums."""

    forward_bytes: Sequence[float]
    backward_bytes: Sequence[float]
    input_bytes: float = 0.0
    param_bytes: Sequence[float] = ()  # per stage (empty: no averaging counted)
    tensors: Sequence[int] = ()  # per stage (empty: one each)


@dataclass(frozen=True)
class LabTrain:
    batch_size: int
    micro_batches: int
    in_flight: int | None = None  # None: the trainer's default (two per stage, at most 64)
    round_trips: int = 3  # the step's rounds after its last micro-batch (throughput_figures.step_round_trips)


@dataclass(frozen=True)
class LabSetup:
    stages: int
    replicas: int | Sequence[int]  # every stage's, or one per stage
    bandwidth_mbit: float
    delay_ms: float
    stage_ms_per_sample: Sequence[float]  # compute per sample, forward and backward, one per stage
    traffic: LabTraffic
    train: LabTrain = field(default_factory=lambda: LabTrain(128, 32))


def lab_step(setup: LabSetup) -> SwarmStep:
    """The fluid model's step of a lab run: every process (the trainer too) on a link of the rate
    each way (namespaces shape both), the one-way delay on every hop."""
    replicas = [setup.replicas] * setup.stages if isinstance(setup.replicas, int) else list(setup.replicas)
    if len(replicas) != setup.stages or len(setup.stage_ms_per_sample) != setup.stages:
        raise ValueError(f"{setup.stages} stages need one replica count and one compute time each")
    size = setup.train.batch_size / setup.train.micro_batches
    link = Link(setup.bandwidth_mbit * 1e6, setup.bandwidth_mbit * 1e6, setup.delay_ms / 1000)
    stages = [
        [Replica(link, ms / 1000 * size / 2)] * n for ms, n in zip(setup.stage_ms_per_sample, replicas, strict=True)
    ]
    t = setup.traffic
    default = min(2 * setup.stages, Settings().limits.max_requests_per_sender)
    return SwarmStep(
        stages=stages,
        payloads=Payloads(
            [b * size for b in t.forward_bytes], [b * size for b in t.backward_bytes], t.input_bytes * size
        ),
        schedule=Schedule(
            setup.train.micro_batches,
            setup.train.in_flight or default,
            Settings().streams.sending_per_neighbour,
            setup.train.round_trips,
        ),
        trainer=link,
    )


def lab_averaging_s(setup: LabSetup) -> float:
    """The slowest replicated stage's exact sum in the step's gather round (module scale_model)."""
    averaging = 0.0
    for s, replicas in enumerate(lab_step(setup).stages):
        if setup.traffic.param_bytes:
            tensors = setup.traffic.tensors[s] if setup.traffic.tensors else 1
            workload = Workload(param_bytes=setup.traffic.param_bytes[s], tensors=tensors)
            averaging = max(averaging, averaging_s([r.link for r in replicas], workload))
    return averaging


def lab_samples_per_s(setup: LabSetup) -> float:
    """Samples/s the model predicts for a lab run: its step in the fluid model, then the slowest
    replicated stage's all-reduce."""
    seconds = simulate_swarm(lab_step(setup)).step_s + lab_averaging_s(setup)
    return setup.train.batch_size / seconds if seconds > 0 else math.inf
