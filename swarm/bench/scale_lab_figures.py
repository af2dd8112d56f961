"""One lab point of the scale benchmark (`python -m swarm bench scale-lab`) as a row of
docs/bench/scale.json (kind "lab"), the scale model's prediction beside it.

From a finished lab run: its results rows (the trainer's), its peers' timelines (`--trace`: each
stage peer's `gather` span per step, which holds its replicas' all-reduce) and each stage peer's
peak memory, it takes
- samples/s over the steady steps (the first `WARMUP_STEPS` left out, as bench throughput does);
- the micro-batches each replica ran over those steps (is routing balanced?);
- each stage's gather round per step (its peers' mean): with replicas, their exact sum's all-reduce
  over hivemind in a group of that stage's replicas; without, the local gradients' set alone;
- the bytes per sample of every boundary (payload) and what the links counted (`wire_overhead`:
  the stage peers' link bytes over their payload bytes, framing, TLS, ACKs and DHT traffic);
- how the stage peers' links ran (swarm.bench.scale_lab_links): busy fraction, payload rate while
  sending;
- the model's samples/s for the same swarm (`swarm.bench.scale_lab.lab_samples_per_s`) with the
  compute, the payloads and the links' payload rate while sending measured (`sending_share` of the
  link: the fastest stage peer's, at most PAYLOAD_SHARE: the peers pace their payload at that
  share, the rest left to framing and ACKs; below it on a busy machine, the pacer and daemons late
  for a core; slower peers are held back by their receivers' offers, which the model has), and at
  PAYLOAD_SHARE (`model_paced_samples_per_s`). The model's own part is the schedule: routing,
  window, fill and drain, averaging.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from swarm.bench.scale_lab import LabSetup, LabTraffic, LabTrain, lab_averaging_s, lab_samples_per_s
from swarm.bench.scale_lab_links import link_use, steady_window
from swarm.bench.throughput_figures import WARMUP_STEPS, RunLinks, measure_run, step_round_trips
from swarm.transport.hivemind.flow.pacing import PAYLOAD_SHARE


@dataclass(frozen=True)
class LabPoint:
    """What ran: `replicas` peers of each stage (stage -> count), every process's link of
    `bandwidth_mbit` each way and `delay_ms` one way."""

    stages: int
    replicas: dict[int, int]
    bandwidth_mbit: float
    delay_ms: float = 0.0

    @property
    def peers(self) -> int:
        return sum(self.replicas.values())

    def replicas_label(self) -> int | str:
        """Every stage's count when they are equal, else `STAGE=COUNT,...` (swarm lab's --replicas)."""
        counts = set(self.replicas.values())
        if len(counts) == 1:
            return counts.pop()
        return ",".join(f"{s}={n}" for s, n in sorted(self.replicas.items()) if n > 1)


@dataclass(frozen=True)
class StageParams:
    """Each stage's trained parameters: fp32 bytes and tensors (what its replicas' all-reduce sums)."""

    param_bytes: list[float]
    tensors: list[int]


@dataclass
class LabRun:
    """A finished run's outputs: results rows, every peer's timeline by lab name (stage0, stage0.2,
    ...), each stage peer's peak memory by lab name ({"rss", "private", "p2pd"} MiB), and the
    input bytes per sample the trainer sends stage 0."""

    rows: list[dict]
    timelines: dict[str, dict]
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    input_bytes: float = 0.0


def micro_batches_per_replica(rows: list[dict], micro_batch: float, warmup: int = WARMUP_STEPS) -> dict[int, list[int]]:
    """{stage: micro-batches each of its peers ran over the steady steps, most first}; over the
    whole run (the `stages` row) when the step rows' peer lists do not line up (a peer left)."""
    steps = [r for r in rows if r["type"] == "step"]
    first, last = (steps[warmup - 1].get("stages") if warmup else []), steps[-1].get("stages")
    if first is None or last is None or (first and len(first) != len(last)):
        last, first = next((r for r in rows if r["type"] == "stages"), {"stages": []})["stages"], []
    per_stage: dict[int, list[int]] = {}
    for i, peer in enumerate(last):
        before = first[i]["samples"] if first and first[i]["stage"] == peer["stage"] else 0
        per_stage.setdefault(peer["stage"], []).append(round((peer["samples"] - before) / micro_batch))
    return {stage: sorted(counts, reverse=True) for stage, counts in sorted(per_stage.items())}


def gather_seconds(timelines: dict[str, dict], stages: int, measured_from: int) -> list[float | None]:
    """Per stage: its peers' mean `gather` span (seconds) over steps >= `measured_from` (0-based,
    the timeline's step numbers); None for a stage without such spans."""
    spans: dict[int, list[float]] = {}
    for name, trace in timelines.items():
        if not name.startswith("stage"):
            continue
        stage = int(name.removeprefix("stage").split(".", 1)[0])
        for event in trace["traceEvents"]:
            step = event.get("args", {}).get("step")
            if event.get("name") == "gather" and event.get("ph") == "X" and step is not None and step >= measured_from:
                spans.setdefault(stage, []).append(event["dur"] / 1e6)
    return [statistics.fmean(spans[s]) if s in spans else None for s in range(stages)]


def links_used(run: LabRun, point: LabPoint, figures: dict, micro_batch: float) -> dict[str, list[float]]:
    """Over the stage peers: the least and most of their links' busy fraction and payload Mbit/s
    while sending (swarm.bench.scale_lab_links); empty without the trainer's timeline."""
    try:
        window = steady_window(run.timelines.get("trainer", {"traceEvents": []}), WARMUP_STEPS)
    except ValueError:  # no trainer's timeline of the steps
        return {}
    forward, backward = figures["forward_bytes"], figures["backward_bytes"]
    uses = []
    for name, trace in run.timelines.items():
        if name.startswith("stage"):
            stage = int(name.removeprefix("stage").split(".", 1)[0])
            payload = {
                "forward": forward[stage] * micro_batch if stage < point.stages - 1 else 0.0,
                "backward": backward[stage - 1] * micro_batch if stage else 0.0,
            }
            uses.append(link_use(trace, window, stage, payload))
    busy, rates = [u.busy for u in uses], [u.payload_bits_per_s / 1e6 for u in uses if u.busy > 0]
    if not rates:
        return {}
    return {
        "link_busy": [round(min(busy), 2), round(max(busy), 2)],
        "sending_mbit": [round(min(rates), 2), round(max(rates), 2)],
        # the least impeded link's: the model shares links among flows itself (its receivers' offers
        # too), what it lacks is what a lone flow loses (pacing, a busy machine's late pacer and daemon)
        "sending_share": round(max(rates) / point.bandwidth_mbit, 3),
    }


def wire_overhead(
    wire: dict[str, list[float]] | None, forward: list[float], backward: list[float], point: LabPoint
) -> float:
    """The stage peers' link bytes (up and down, as the kernel counted them) over the payload bytes
    they carried, per sample; 1.0 when the links were not counted (no namespaces)."""
    if not wire:
        return 1.0
    payload = 2 * (sum(forward) + sum(backward))  # each payload leaves one stage peer and reaches another
    counted = sum(up + down for name, (up, down) in wire.items() if name.startswith("stage"))
    return counted / payload if payload else 1.0


def model_setup(point: LabPoint, figures: dict, params: StageParams, train: dict, overhead: float) -> LabSetup:
    """The scale model's lab swarm for `point`, with the run's measured compute and bytes; the
    payloads scaled by `overhead` (what the links carry beside them)."""
    return LabSetup(
        stages=point.stages,
        replicas=[point.replicas[s] for s in range(point.stages)],
        bandwidth_mbit=point.bandwidth_mbit,
        delay_ms=point.delay_ms,
        stage_ms_per_sample=figures["stage_ms_per_sample"],
        traffic=LabTraffic(
            forward_bytes=[b * overhead for b in figures["forward_bytes"]],
            backward_bytes=[b * overhead for b in figures["backward_bytes"]],
            input_bytes=figures["input_bytes"] * overhead,
            param_bytes=params.param_bytes,
            tensors=params.tensors,
        ),
        train=LabTrain(train["batch_size"], train["micro_batches"], train.get("in_flight"), figures["round_trips"]),
    )


def lab_row(point: LabPoint, run: LabRun, params: StageParams) -> dict:
    """The row of one lab run (module doc); ValueError if it has too few steps to measure."""
    links = RunLinks(point.bandwidth_mbit * 1e6, point.delay_ms / 1000, download_limited=True)
    figures = measure_run(run.rows, point.stages, links, run.input_bytes)
    config = next(r for r in run.rows if r["type"] == "config")["config"]
    train = config["train"]
    summary = next((r for r in run.rows if r["type"] == "summary"), None)
    figures |= {"input_bytes": run.input_bytes, "round_trips": step_round_trips(config, summary)}
    overhead = wire_overhead(
        figures["wire_bytes_per_sample"], figures["forward_bytes"], figures["backward_bytes"], point
    )
    micro_batch = train["batch_size"] / train["micro_batches"]
    used = links_used(run, point, figures, micro_batch)
    # a link's payload rate while it sends: what the peers measured, at most what they pace at
    share = min(PAYLOAD_SHARE, used.get("sending_share", PAYLOAD_SHARE))
    setup = model_setup(point, figures, params, train, 1 / share)
    model = lab_samples_per_s(setup)
    paced = lab_samples_per_s(model_setup(point, figures, params, train, 1 / PAYLOAD_SHARE))
    routed = micro_batches_per_replica(run.rows, micro_batch)
    gathers = gather_seconds(run.timelines, point.stages, WARMUP_STEPS)
    replicated = [s for s in range(point.stages) if point.replicas[s] > 1]
    stage_memory = [m for name, m in run.memory.items() if name.startswith("stage")]

    def peak(key: str) -> float | None:
        return round(max(m[key] for m in stage_memory), 1) if stage_memory else None

    return {
        "kind": "lab",
        "stages": point.stages,
        "replicas": point.replicas_label(),
        "peers": point.peers,
        "bandwidth_mbit": point.bandwidth_mbit,
        "delay_ms": point.delay_ms,
        "samples_per_s": round(figures["samples_per_s"], 3),
        "model_samples_per_s": round(model, 3),
        "rss_mib_per_peer": peak("rss"),
        "model_error": round(model / figures["samples_per_s"] - 1, 3),
        "private_mib_per_peer": peak("private"),
        "p2pd_rss_mib_per_peer": peak("p2pd"),
        "micro_batches_per_replica": {str(s): counts for s, counts in routed.items()},
        "gather_s": [None if g is None else round(g, 3) for g in gathers],
        "allreduce_s": round(max(gathers[s] or 0.0 for s in replicated), 3) if replicated else None,
        "model_allreduce_s": round(lab_averaging_s(setup), 3),
        "allreduce_group": max((point.replicas[s] for s in replicated), default=1),
        "wire_overhead": round(overhead, 3),
        **used,
        "model_paced_samples_per_s": round(paced, 3),
        "forward_bytes": [round(b) for b in figures["forward_bytes"]],
        "stage_ms_per_sample": [round(ms, 2) for ms in figures["stage_ms_per_sample"]],
        "machine_busy": None if figures["machine_busy"] is None else round(figures["machine_busy"], 2),
        "steps": figures["steps"],
    }
