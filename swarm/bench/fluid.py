"""What the pipeline's schedule allows on ideal links: a fluid model of one synchronous step.

The link bound (swarm.bench.bounds) assumes the busiest link never idles. A real step cannot
reach it: the pipeline fills and drains, and a link carrying both waves waits on the other. This
model replays the swarm's schedule (micro-batches admitted `in_flight` at a time by the trainer,
at most `sending` payloads in transfer per neighbour, one compute thread per stage, backward in
forward order) on access links that share their rate among the transfers crossing them (a
transfer from A to B uses A's up and B's down link) max-min fairly in proportion to the transfers'
sizes, as the peers' pacing shares them (swarm.transport.hivemind.flow.pacing: payloads written together finish
together), with no loss or protocol overhead. Every hop (a payload, a reply to the trainer) arrives
`delay_s` after its last byte left (the one-way latency; the link is free again as soon as the
bytes are out), and after the last micro-batch the step's `round_trips` from the trainer to every
stage and back (the synchronous step's rounds) each cost two delays. Its step time is what a perfect
network of that rate and latency would give this schedule; a measured step much slower than that
points at the transport, not the schedule.

    model = StepModel(stages=4, micro_batches=64, in_flight=16, sending=1,
                      forward_bytes=[2**20] * 3, backward_bytes=[2**20] * 3,
                      compute_s=[0.01] * 4, rate_bits=100e6)
    simulate(model).step_s       # seconds of one step

It runs on the model of a swarm with replicas (swarm.bench.fluid_swarm), one replica per stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.bench.fluid_swarm import (
    FluidResult,
    Link,
    Payloads,
    Replica,
    Schedule,
    SwarmStep,
    Transfer,
    max_min_rates,
    simulate_swarm,
)

__all__ = ["FluidResult", "StepModel", "Transfer", "max_min_rates", "simulate", "swarm_step"]


@dataclass(frozen=True)
class StepModel:
    stages: int
    micro_batches: int
    in_flight: int
    sending: int  # payloads in transfer at once per neighbour (the transport settings' sending_per_neighbour)
    forward_bytes: Sequence[float]  # per micro-batch, boundary j = stage j -> j + 1
    backward_bytes: Sequence[float]
    compute_s: Sequence[float]  # per micro-batch and stage, forward or backward (each)
    rate_bits: float  # every process's access link, each direction
    input_bytes: float = 0.0  # trainer -> stage 0, per micro-batch
    download_limited: bool = True  # False: only what a process sends is shaped (in-process shaping)
    delay_s: float = 0.0  # one way, every hop
    round_trips: int = 0  # of the step's rounds after its last micro-batch (trainer -> stages -> trainer)

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise ValueError(f"the model needs at least 2 stages, got {self.stages}")
        for name, values, n in (
            ("forward_bytes", self.forward_bytes, self.stages - 1),
            ("backward_bytes", self.backward_bytes, self.stages - 1),
            ("compute_s", self.compute_s, self.stages),
        ):
            if len(values) != n:
                raise ValueError(
                    f"{name} needs {n} values (one per {'boundary' if n < self.stages else 'stage'}), got {len(values)}"
                )
        if min(self.micro_batches, self.in_flight, self.sending) < 1 or self.rate_bits <= 0:
            raise ValueError("micro_batches, in_flight, sending and rate_bits must be positive")
        if self.delay_s < 0 or self.round_trips < 0:
            raise ValueError("delay_s and round_trips cannot be negative")


def swarm_step(m: StepModel) -> SwarmStep:
    """The same step in the swarm model: one replica per stage, every process on a link of the rate."""
    link = Link(m.rate_bits, m.rate_bits if m.download_limited else math.inf, m.delay_s)
    return SwarmStep(
        stages=[[Replica(link, seconds)] for seconds in m.compute_s],
        payloads=Payloads(m.forward_bytes, m.backward_bytes, m.input_bytes),
        schedule=Schedule(m.micro_batches, m.in_flight, m.sending, m.round_trips),
        trainer=link,
    )


def simulate(model: StepModel) -> FluidResult:
    return simulate_swarm(swarm_step(model))
