"""A stage peer's metrics, from the status it gives `peers.status` (read on its event loop at each
scrape): per hosted stage its micro-batches, samples/s, queue, error-feedback state, the split of
its time (computing, sending, waiting), retries and bans; per link and direction the bytes out and
in, what they weighed uncompressed, the compression ratio and the rate payloads arrive at; for the
peer its refusals, the callers it bans and its events by kind (joins, leaves, bans, pauses)."""

from __future__ import annotations

import asyncio

from protocols import stage_pb2 as pb
from swarm.transport.hivemind.monitor.exporter import Collector, Families
from swarm.transport.hivemind.monitor.peer_metrics import fill_events, fill_node
from swarm.transport.hivemind.stage.status import by_direction

READ_TIMEOUT_S = 5.0  # a scrape gives up on a peer whose event loop is this busy


def fill_stage(families: Families, status: pb.StageStatus) -> None:
    labels = {"run": status.run_id, "stage": status.stage}
    f = families
    f.gauge("stage_ready", "1 once a trainer set this stage up", status.ready, **labels)
    f.gauge(
        "stage_serving",
        "1 while it serves micro-batches (not joining, leaving or idle)",
        status.role == "serving",
        **labels,
    )
    f.counter("stage_micro_batches", "micro-batches processed (training and evaluation)", status.processed, **labels)
    f.gauge("stage_step", "the step its weights are at (goes back when the run does)", status.steps, **labels)
    f.counter("stage_samples", "training samples computed", status.samples, **labels)
    f.gauge("stage_samples_per_second", "throughput (moving average)", status.throughput, **labels)
    f.gauge("stage_queue", "micro-batches inside this stage now", status.queue, **labels)
    f.gauge("stage_feedback_state_bytes", "error-feedback state kept for its links", status.state_bytes, **labels)
    for part, seconds in (("compute", status.compute_s), ("sending", status.sending_s), ("waiting", status.waiting_s)):
        f.counter(
            "stage_seconds", "time computing, sending payloads, or with nothing to do", seconds, part=part, **labels
        )
    f.counter(
        "stage_retries", "micro-batches handed on again after a peer of the next stage failed", status.retries, **labels
    )
    f.counter("stage_bans", "peers of the next stage it stopped routing to for a while", status.bans, **labels)
    f.counter("stage_states_served", "state downloads it gave joiners", status.states_served, **labels)
    f.counter("stage_restores", "times it went back to the swarm's copies", status.restores, **labels)
    for link in status.links:
        # the direction this peer sends on this link, and the one that arrives here
        out_dir, in_dir = ("forward", "backward") if link.upstream else ("backward", "forward")
        at = {**labels, "neighbour": link.neighbour, "boundary": link.boundary}
        sent, raw, received = by_direction(link.sent), by_direction(link.raw), by_direction(link.received)
        f.counter(
            "link_sent_bytes", "payload bytes sent to the neighbour", sent.get(out_dir, 0), direction=out_dir, **at
        )
        doc = "what the bytes sent weighed before compression"
        f.counter("link_uncompressed_bytes", doc, raw.get(out_dir, 0), direction=out_dir, **at)
        doc = "payload bytes received from the neighbour"
        f.counter("link_received_bytes", doc, received.get(in_dir, 0), direction=in_dir, **at)
        if sent.get(out_dir) and raw.get(out_dir):
            doc = "uncompressed / sent bytes of what this peer sends"
            f.gauge("link_compression_ratio", doc, raw[out_dir] / sent[out_dir], direction=out_dir, **at)
        if link.busy_s > 0:
            doc = "rate the neighbour's payloads arrive at while arriving"
            f.gauge("link_arrival_bits_per_second", doc, link.busy_bytes * 8 / link.busy_s, direction=in_dir, **at)


class StageCollector(Collector):
    """`server`: the peer's StageServer, serving on `loop`."""

    def __init__(self, server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    async def _read(self) -> tuple[pb.InfoReply, dict[str, int]]:
        return self.server.status(), dict(self.server.events.counts)

    def fill(self, families: Families) -> None:
        fill_node(families, self.server.node)
        reply, events = asyncio.run_coroutine_threadsafe(self._read(), self.loop).result(READ_TIMEOUT_S)
        for status in reply.stages:
            fill_stage(families, status)
        for why, n in sorted(reply.refused.items()):
            families.counter("refused_requests", "requests it refused, by why", n, why=why)
        families.gauge(
            "banned_callers", "peers it refuses now (malformed bytes, or refusals that cost too much CPU)", reply.banned
        )
        fill_events(families, events, "stage")
