"""What one point of the throughput benchmark achieved and what bounded it, from its results rows.

A point is one shaped swarm run (swarm.bench.throughput); its row holds:
- achieved samples/s over the steady steps (the first `warmup` steps, with connection setup, are
  left out);
- payload bytes per sample of every boundary, forward and backward (what the peers sent);
- the link bound: each process has an access link of the rate in each direction, so a middle
  stage sends forward activations and backward gradients over the same up link; the busiest
  direction of the busiest process bounds samples/s. With namespaces, the bytes are those the
  kernel counted on each link over the measured steps (swarm.netlab.counters: the payload plus
  TCP/IP, TLS and libp2p framing, ACKs and DHT traffic, all of which tbf meters); in process, the
  payload (swarm.bench.bounds.pipeline_bound, also reported as `payload_link_bound`);
- the compute bound: 1 / the slowest stage's measured compute seconds per sample (compression
  included) over the measured steps, from the stage peers' own accounting; and since the lab's
  peers share this machine's cores, at most cores / the sum of the stages' compute CPU seconds
  per sample (the computing threads' CPU time, so waiting for a core is not counted as work);
- achieved / min(link bound, compute bound);
- what this schedule allows on ideal links (swarm.bench.fluid), to tell the schedule's losses from
  the transport's;
- how busy the machine's cores were over the measured steps (`machine_busy`), and where that CPU
  went per sample: the stages' computing threads (`compute_cpu_ms_per_sample`), each process and
  its p2p daemon (`cpu_ms_per_sample`; a stage process's other threads are its event loop,
  framing and pacing, and torch's workers when it runs more than one). The fraction of the cores
  bound is machine_busy x the computing threads' share of the busy CPU (`compute_share`): the
  event loops, daemons and trainer on the same cores take the rest. /proc/stat counts busy time
  by the tick and misses the daemons' short bursts at low load, so there the processes' own
  times can add up to more than the machine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.bench.bounds import fraction_of_bound, pipeline_bound, shared_cores_bound
from swarm.bench.fluid import StepModel, simulate
from swarm.bench.points import Achieved, Point, flat_json, from_flat_json
from swarm.netlab.counters import window
from swarm.transport.hivemind.net.settings import Settings

WARMUP_STEPS = 1


@dataclass
class OtherBounds:
    """The bounds beside the link and compute ones a point is judged by (`Achieved`)."""

    schedule_bound: float  # what this schedule allows on ideal fair links of the point's delay (swarm.bench.fluid)
    schedule_fraction: float | None = None  # achieved / schedule_bound
    cores_bound: float | None = None  # what the shared cores allow (None: not measured); compute_bound includes it
    payload_link_bound: float | None = None  # the link bound from the payload bytes alone (no headers, ACKs, DHT)


@dataclass
class Traffic:
    """Bytes per training sample: each boundary's payload, what each link counted, the busiest link's."""

    busiest_bytes_per_sample: float  # on the binding link: counted by the kernel when measured, else the payload
    forward_bytes: list[float]  # per boundary
    backward_bytes: list[float]
    wire_bytes_per_sample: dict[str, list[float]] | None = None  # per process: [up, down] as its link counted them


@dataclass
class CpuUse:
    """Where the time went per sample over the measured steps: each stage's compute, and the
    machine's CPU (None: not measured, see the module doc)."""

    stage_ms_per_sample: list[float]
    machine_busy: float | None = None  # fraction of the machine's CPU time busy
    machine_cpu_ms_per_sample: float | None = None  # the machine's busy CPU time
    compute_cpu_ms_per_sample: float | None = None  # the stages' computing threads' CPU time, summed
    compute_share: float | None = None  # compute_cpu_ms_per_sample / machine_cpu_ms_per_sample
    cpu_ms_per_sample: dict[str, list[float]] | None = None  # per process: [its own, its p2p daemon's]


@dataclass
class ThroughputRow:
    """One point of the throughput benchmark; its JSON is flat (`to_json`, `from_json`)."""

    point: Point
    achieved: Achieved
    bounds: OtherBounds
    traffic: Traffic
    cpu: CpuUse
    steps: int
    chosen: dict[str, str] | None = None  # adaptive:*: the codecs per boundary at the end of the run

    def to_json(self) -> dict:
        return flat_json(self)

    @classmethod
    def from_json(cls, flat: dict) -> ThroughputRow:
        """From a flat object: a JSON file's, or a point's settings with measure_run's figures."""
        return from_flat_json(cls, flat)


def step_round_trips(config: dict, summary: dict | None = None) -> int:
    """Round trips from the trainer to every stage after a step's last micro-batch: none when every
    step of the run closed on the way (swarm.transport.hivemind.trainer.closing); else the rounds'
    (swarm.engine.step over swarm.transport.hivemind.trainer.rounds): gather and apply, and
    set_grads for the norm when gradients are clipped."""
    if summary is not None and summary.get("steps") and summary.get("closed_on_the_way") == summary["steps"]:
        return 0
    return 2 + (config.get("optimizer", {}).get("grad_clip") is not None)


@dataclass(frozen=True)
class RunLinks:
    """Every process's access link as a run had it: its rate in bits/s, its one-way delay, and
    whether downloads were shaped too (namespaces) or only uploads."""

    bandwidth_bits: float
    delay_s: float = 0.0
    download_limited: bool = True


@dataclass(frozen=True)
class PerSample:
    """What a run carried and computed per sample: bytes over each boundary forward and backward,
    each stage's compute seconds (None: not measured), and the input's bytes to stage 0."""

    forward: list[float]
    backward: list[float]
    stage_s: list[float] | None
    input_bytes: float


def schedule_bound(train: dict, stages: int, links: RunLinks, measured: PerSample, round_trips: int = 0) -> float:
    """samples/s of this schedule in the fluid model, with the measured bytes and compute, the links
    and the step's `round_trips`. The asynchronous schedule keeps two steps open: its window
    streams two steps' micro-batches, the pipeline filled and drained once for both."""
    size = train["batch_size"] / train["micro_batches"]
    in_flight = train.get("in_flight") or 2 * stages
    open_steps = 2 if train.get("schedule") == "async" else 1
    stage_s = measured.stage_s
    # forward and backward each
    compute = [s * size / 2 for s in stage_s] if stage_s and len(stage_s) == stages else [0.0] * stages
    model = StepModel(
        stages,
        open_steps * train["micro_batches"],
        in_flight,
        Settings().streams.sending_per_neighbour,
        [b * size for b in measured.forward],
        [b * size for b in measured.backward],
        compute,
        links.bandwidth_bits,
        measured.input_bytes * size,
        links.download_limited,
        links.delay_s,
        round_trips,
    )
    return open_steps * train["batch_size"] / simulate(model).step_s


def measure_run(
    rows: list[dict],
    stages: int,
    links: RunLinks,
    input_bytes: float,
    warmup: int = WARMUP_STEPS,
    cores: float | None = None,
) -> dict:
    """The figures of one finished run's results rows (see module doc); `cores`: the stages share
    that many cores (None: each has its own hardware)."""
    bandwidth_bits = links.bandwidth_bits
    steps = [r for r in rows if r["type"] == "step"]
    if len(steps) <= warmup:
        raise ValueError(
            f"the run has {len(steps)} steps; at least {warmup + 1} are needed (the first {warmup} warm up)"
        )
    first, last = steps[warmup - 1] if warmup else {"samples": 0, "time_s": 0.0}, steps[-1]
    samples = last["samples"] - first["samples"]
    achieved = samples / (last["time_s"] - first["time_s"])
    forward, backward = [0.0] * (stages - 1), [0.0] * (stages - 1)
    for row in steps[warmup:]:
        for key, n in row["bytes"].items():  # "boundary<i>.<direction>.<mode>"
            boundary, direction, mode = key.split(".")[:3]
            if mode != "train":  # an evaluation's traffic, counted in the next step's row
                continue
            (forward if direction == "forward" else backward)[int(boundary.removeprefix("boundary"))] += n / samples
    per_stage = stage_compute(rows, first, last)
    stage_s = [seconds / count for seconds, _, count in per_stage.values() if count] or None
    stage_cpu = [cpu / count for _, cpu, count in per_stage.values() if count]
    bound = pipeline_bound(
        bandwidth_bits,
        forward,
        backward,
        stage_s,
        names=[f"stage{i}" for i in range(stages)],
        input_bytes=input_bytes,
    )
    link, busiest, busiest_bytes = bound.link, f"{bound.busiest} {bound.direction}", bound.wire_bytes
    meter = metered(rows, first, last, samples)
    wire = meter["wire_bytes_per_sample"]
    if wire:  # the links' own counts: the bound is what tbf lets through, headers and ACKs included
        (busiest, busiest_bytes) = max(
            ((f"{name} {d}", b) for name, pair in wire.items() for d, b in zip(("up", "down"), pair, strict=True)),
            key=lambda item: item[1],
        )
        link = bandwidth_bits / 8 / busiest_bytes if busiest_bytes else math.inf
    cores_bound = shared_cores_bound(cores, stage_cpu) if cores and any(stage_cpu) else None
    compute = min(bound.compute, cores_bound or math.inf)
    if link <= compute:
        binding = f"link {busiest}"
    else:
        binding = "compute" if compute == bound.compute else f"cores ({cores:g} shared)"
    config = next(r for r in rows if r["type"] == "config")["config"]
    compute_cpu, machine_cpu = 1000 * sum(stage_cpu) if any(stage_cpu) else None, meter["machine_cpu_ms_per_sample"]
    scheduled = schedule_bound(
        config["train"],
        stages,
        links,
        PerSample(forward, backward, stage_s, input_bytes),
        step_round_trips(config, next((r for r in rows if r["type"] == "summary"), None)),
    )
    return {
        "samples_per_s": achieved,
        "schedule_bound": scheduled,
        "schedule_fraction": achieved / scheduled if scheduled else None,
        "link_bound": link,
        "compute_bound": compute,
        "cores_bound": cores_bound,
        "fraction_of_bound": fraction_of_bound(achieved, link, compute),
        "binding": binding,
        "busiest_bytes_per_sample": busiest_bytes,
        "payload_link_bound": bound.link,
        **meter,
        "compute_cpu_ms_per_sample": compute_cpu,
        "compute_share": compute_cpu / machine_cpu if compute_cpu and machine_cpu else None,
        "forward_bytes": forward,
        "backward_bytes": backward,
        "stage_ms_per_sample": [1000 * s for s in stage_s or []],
        "steps": len(steps),
        "chosen": steps[-1].get("codecs"),
    }


def stage_compute(rows: list[dict], first: dict, last: dict) -> dict[int, list[float]]:
    """{stage: [compute seconds, computing threads' CPU seconds, samples]} of its peers between two
    step rows (their running totals, `SwarmPipeline.step_notes`); over the whole run (the `stages`
    row) when the step rows do not carry them (an older results file) or a peer left meanwhile."""

    def totals(peers: list[dict]) -> dict[int, list[float]]:
        per_stage: dict[int, list[float]] = {}
        for peer in peers:
            seconds, cpu, count = per_stage.get(peer["stage"], [0.0, 0.0, 0])
            per_stage[peer["stage"]] = [
                seconds + peer["compute_s"],
                cpu + peer.get("compute_cpu_s", 0.0),
                count + peer["samples"],
            ]
        return per_stage

    if "stages" in last and ("stages" in first or "step" not in first):  # no warm-up: from the start
        before, after = totals(first.get("stages", [])), totals(last["stages"])
        between = {
            stage: [a - b for a, b in zip(now, before.get(stage, [0.0, 0.0, 0]), strict=True)]
            for stage, now in after.items()
        }
        if set(before) <= set(after) and all(
            count > 0 and seconds >= 0 and cpu >= 0 for seconds, cpu, count in between.values()
        ):
            return between
    return totals(next((r for r in rows if r["type"] == "stages"), {"stages": []})["stages"])


def metered(rows: list[dict], first: dict, last: dict, samples: int) -> dict:
    """Per sample between two step rows, from a lab's meter row (all None without one: an older
    results file, or a run outside the lab): `wire_bytes_per_sample` {process: [bytes up, bytes
    down]} (None without namespaces), `machine_busy` (fraction), `machine_cpu_ms_per_sample`,
    `cpu_ms_per_sample` {process: [its own, its p2p daemon's] CPU ms} (None if not sampled)."""
    meter = next((r for r in rows if r["type"] == "meter"), None)
    if meter is None or "at" not in first or "at" not in last:
        return dict.fromkeys(
            ("wire_bytes_per_sample", "machine_busy", "machine_cpu_ms_per_sample", "cpu_ms_per_sample")
        )
    counted = window(meter, first["at"], last["at"])
    return {
        "wire_bytes_per_sample": {
            name: [counted.sent[name] / samples, counted.received[name] / samples] for name in counted.sent
        }
        or None,
        "machine_busy": counted.busy,
        "machine_cpu_ms_per_sample": 1000 * counted.busy_s / samples,
        "cpu_ms_per_sample": {name: [1000 * s / samples for s in pair] for name, pair in counted.cpu.items()} or None,
    }
