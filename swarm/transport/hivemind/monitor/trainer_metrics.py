"""The trainer's metrics and its status record, from its `SwarmPipeline` and the run's progress
(a `swarm.training.progress.RunProgress`, fed the run's results rows): step, loss, samples/s, time left, the split of its time
(its own work, sending inputs, waiting on the swarm), peers in service per stage, retries, bans,
pauses, its events by kind, and the bytes every link of the run carried as the stage peers last
reported them (those that left included)."""

from __future__ import annotations

import time
from collections import Counter

from swarm.transport.hivemind.dht.runstatus import RunStatus
from swarm.transport.hivemind.monitor.exporter import Collector, Families
from swarm.transport.hivemind.monitor.peer_metrics import fill_events
from swarm.transport.hivemind.stage.status import by_direction

EVENTS_SHOWN = 20  # of the trainer's recent events, in its status record


def run_status(pipeline, progress) -> RunStatus:
    """The record the trainer publishes for the health page (`runstatus.StatusPublisher`)."""
    return RunStatus(
        step=progress.step,
        total_steps=progress.total_steps,
        loss=progress.loss,
        samples_per_s=progress.samples_per_s,
        eta_s=progress.eta_s,
        state=pipeline.state,
        members={stage: len(pipeline.serving(stage)) for stage in range(pipeline.num_stages)},
        events=pipeline.events.last(EVENTS_SHOWN),
        trainer=pipeline.node.peer_id,
    )


def run_link_bytes(pipeline) -> tuple[Counter, Counter]:
    """(sent, uncompressed) bytes per (boundary, direction), summed over the stage peers' reports."""
    sent, raw = Counter(), Counter()
    for status in list(pipeline.accounts.reported.values()):
        for link in status.links:
            for counts, into in ((link.sent, sent), (link.raw, raw)):
                for direction, n in by_direction(counts).items():
                    into[(link.boundary, direction)] += n
    return sent, raw


class TrainerCollector(Collector):
    def __init__(self, pipeline, progress) -> None:
        self.pipeline, self.progress = pipeline, progress
        self.started = time.monotonic()

    def fill(self, families: Families) -> None:
        p, f = self.pipeline, families
        run = {"run": p.run_id}
        now = self.progress.snapshot()
        f.gauge("trainer_step", "optimizer steps done", now["step"], **run)
        if now["total_steps"]:
            f.gauge("trainer_total_steps", "steps the run will take", now["total_steps"], **run)
        f.gauge(
            "trainer_samples", "training samples the run is at (goes back when the run does)", now["samples"], **run
        )
        f.gauge(
            "trainer_samples_per_second", "training samples per second over the last steps", now["samples_per_s"], **run
        )
        for name, doc in (("loss", "the last step's training loss"), ("lr", "the last step's learning rate")):
            if now[name] is not None:
                f.gauge(f"trainer_{name}", doc, now[name], **run)
        if now["eta_s"] is not None:
            f.gauge("trainer_eta_seconds", "time left at the last steps' pace", now["eta_s"], **run)
        for metric, value in sorted(now["evaluation"].items()):
            f.gauge("trainer_evaluation", "the last evaluation (uncompressed)", value, metric=metric, **run)
        in_swarm, sending = p.in_swarm.seconds, p.handoff.sending.busy.seconds
        wall = time.monotonic() - self.started
        split = {"compute": max(0.0, wall - in_swarm), "sending": sending, "waiting": max(0.0, in_swarm - sending)}
        for part, seconds in split.items():
            f.counter(
                "trainer_seconds",
                "time on its own work, sending inputs, waiting on the swarm",
                seconds,
                part=part,
                **run,
            )
        f.gauge(
            "trainer_paused", "1 while the run waits for a stage to have a peer", p.state.startswith("paused"), **run
        )
        for stage in range(p.num_stages):
            f.gauge("trainer_members", "peers in service per stage", len(p.serving(stage)), stage=stage, **run)
        f.counter(
            "trainer_retries", "micro-batches and calls tried again", p.handoff.retries + p.place.retry.retries, **run
        )
        f.counter("trainer_bans", "peers it stopped routing to for a while", p.router.banned_total, **run)
        pauses = list(p.recovery.history.pauses)
        f.counter("trainer_pauses", "times a stage lost its last peer", len(pauses), **run)
        f.counter("trainer_paused_seconds", "time the run waited in pauses", sum(x["paused_s"] for x in pauses), **run)
        fill_events(f, dict(p.events.counts), "trainer")
        sent, raw = run_link_bytes(p)
        for (boundary, direction), n in sorted(sent.items()):
            at = {"boundary": boundary, "direction": direction, **run}
            f.counter("run_link_bytes", "bytes every peer sent on a boundary, as they last reported", n, **at)
            if n and raw[(boundary, direction)]:
                f.gauge(
                    "run_link_compression_ratio",
                    "uncompressed / sent bytes on a boundary",
                    raw[(boundary, direction)] / n,
                    **at,
                )
