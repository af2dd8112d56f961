"""A hosted stage's status for an info request: what it runs, its queue, compute, and per link (one per
neighbour, counted across the link's epochs) the bytes sent and received, their uncompressed size,
how fast the neighbour's payloads arrived, and the codecs of the end in use."""

from __future__ import annotations

import time
from collections import Counter

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.stage.links import NeighbourLinks
from swarm.transport.hivemind.stage.state import StageMeters, StagePlace, StageState


def by_direction(counts) -> Counter:
    """A link's byte counts ("<direction>.<mode>" keys) summed per direction (every mode)."""
    out: Counter = Counter()
    for key, n in counts.items():
        out[key.split(".", 1)[0]] += n
    return out


def stage_status(place: StagePlace, state: StageState, meters: StageMeters, links: NeighbourLinks) -> pb.StageStatus:
    """What the stage's own state says; its collaborators add theirs (`HostedStage.status`)."""
    clock = meters.clock
    out = pb.StageStatus(
        run_id=place.run_id,
        stage=place.stage,
        num_stages=place.num_stages,
        ready=state.runtime is not None,
        throughput=meters.throughput,
        queue=meters.queue,
        processed=meters.processed,
        steps=state.steps,
        compute_s=clock.seconds,
        compute_cpu_s=clock.cpu_seconds,
        samples=clock.samples,
        role=state.role,
    )
    if meters.serving_since:
        out.waiting_s = max(0.0, time.monotonic() - meters.serving_since - meters.occupied.seconds)
    if state.joined is not None:
        out.joined_step, out.state_bytes_in, out.state_seconds = state.joined
    if place.stage > 0:
        link = state.cfg.compression.link(place.stage - 1)
        out.forward_codec, out.backward_codec = link.forward, link.backward
    if state.runtime is None:
        return out
    out.state_bytes = links.state_bytes()
    for upstream, ends in ((False, links.ends_in), (True, links.ends_out)):
        neighbours = dict.fromkeys([*ends, *(n for n, up in links.retired if up == upstream)])
        for neighbour in neighbours:
            end = ends.get(neighbour)
            boundary, sent, raw = links.retired.get(
                (neighbour, upstream), (end.boundary if end else 0, Counter(), Counter())
            )
            if end is not None:
                sent, raw = sent + end.bytes, raw + end.raw
            link = out.links.add(neighbour=neighbour, boundary=boundary, upstream=upstream)
            for (mode, direction), n in sent.items():
                link.sent[f"{direction}.{mode}"] = n
            for (mode, direction), n in raw.items():
                link.raw[f"{direction}.{mode}"] = n
            for (peer, direction, mode), n in links.received.items():
                if peer == neighbour:
                    link.received[f"{direction}.{mode}"] = n
            meter = (links.replies if upstream else links.arrivals).get(neighbour)
            if meter is not None:
                link.busy_s, link.busy_bytes = meter.busy_s, meter.nbytes
            if end is not None:  # the end in use; a replaced one's codecs are history
                link.forward_codec, link.backward_codec = end.forward_spec.text, end.backward_spec.text
    return out
