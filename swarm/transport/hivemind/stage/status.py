"""A hosted stage's status for `rpc_info`: what it runs, its queue, compute, and per link (one per
neighbour, counted across the link's epochs) the bytes sent and received, their uncompressed size,
how fast the neighbour's payloads arrived, and the codecs of the end in use."""

from __future__ import annotations

from collections import Counter

from protocols import stage_pb2 as pb


def stage_status(hosted) -> pb.StageStatus:
    out = pb.StageStatus(
        run_id=hosted.run_id,
        stage=hosted.stage,
        num_stages=hosted.num_stages,
        ready=hosted.runtime is not None,
        throughput=hosted.throughput,
        queue=hosted.queue,
        processed=hosted.processed,
        steps=hosted.steps,
        compute_s=hosted.compute.seconds,
        compute_cpu_s=hosted.compute.cpu_seconds,
        samples=hosted.compute.samples,
    )
    if hosted.stage > 0:
        link = hosted.cfg.compression.link(hosted.stage - 1)
        out.forward_codec, out.backward_codec = link.forward, link.backward
    if hosted.runtime is None:
        return out
    out.state_bytes = sum(end.state_bytes for end in (*hosted.ends_in.values(), *hosted.ends_out.values()))
    for upstream, ends in ((False, hosted.ends_in), (True, hosted.ends_out)):
        neighbours = dict.fromkeys([*ends, *(n for n, up in hosted.retired if up == upstream)])
        for neighbour in neighbours:
            end = ends.get(neighbour)
            boundary, sent, raw = hosted.retired.get(
                (neighbour, upstream), (end.boundary if end else 0, Counter(), Counter())
            )
            if end is not None:
                sent, raw = sent + end.bytes, raw + end.raw
            link = out.links.add(neighbour=neighbour, boundary=boundary, upstream=upstream)
            for (mode, direction), n in sent.items():
                link.sent[f"{direction}.{mode}"] = n
            for (mode, direction), n in raw.items():
                link.raw[f"{direction}.{mode}"] = n
            for (peer, direction, mode), n in hosted.received.items():
                if peer == neighbour:
                    link.received[f"{direction}.{mode}"] = n
            meter = (hosted.replies if upstream else hosted.arrivals).get(neighbour)
            if meter is not None:
                link.busy_s, link.busy_bytes = meter.busy_s, meter.nbytes
            if end is not None:  # the end in use; a replaced one's codecs are history
                link.forward_codec, link.backward_codec = end.forward_spec.text, end.backward_spec.text
    return out
