"""The swarm `python -m swarm bench fuzz` attacks: a bootstrap peer, one stage host per stage and the
trainer in this process (real hivemind daemons on loopback), training `steps` steps of a config
while `swarm.bench.fuzz.campaign` sends its malformed messages; then the same run in one process,
the oracle its losses must equal.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from swarm.bench.fuzz import Tally, max_rss_mib
from swarm.bench.fuzz_campaign import Plan, Senders, Served, campaign
from swarm.bench.fuzz_cases import targets_of
from swarm.bench.fuzz_floods import FLOODS
from swarm.config import ExperimentConfig
from swarm.training.experiment import build_data, run_experiment
from swarm.training.loop import Schedule, train
from swarm.training.results import ResultsWriter, read_results
from swarm.transport.hivemind.net.loop import LoopThread
from swarm.transport.hivemind.net.node import NodeOptions, SwarmNode
from swarm.transport.hivemind.net.settings import Settings
from swarm.transport.hivemind.stage.host import HostedStage
from swarm.transport.hivemind.stage.server import StageServer
from swarm.transport.hivemind.trainer.pipeline import SwarmPipeline

# a stalled stream is closed after read_timeout_s: shorter than a swarm's default, so the bench ends sooner
SETTINGS = Settings.of(read_timeout_s=10.0, drain_s=5.0, call_timeout_s=60.0)


@dataclass
class FuzzReport:
    tally: Tally
    steps: int
    max_loss_diff: float  # relative, against the single-process run
    memory_mib: float  # growth of this process's peak resident memory during the campaign
    serving: bool  # every stage peer still set up and serving after it


def _losses(rows) -> list[float]:
    return [r["loss"] for r in rows if r["type"] == "step"]


def run(cfg: ExperimentConfig, steps: int, count: int, seed: int = 0, say=print) -> FuzzReport:
    loop = LoopThread("bench-fuzz")
    nodes, servers = [], []
    try:
        boot = loop.run(SwarmNode.create(NodeOptions(settings=SETTINGS)))
        nodes.append(boot)
        initial = loop.run(boot.maddrs())

        def node(client: bool = False) -> SwarmNode:
            created = loop.run(
                SwarmNode.create(NodeOptions(initial_peers=initial, client_mode=client, settings=SETTINGS))
            )
            nodes.append(created)
            return created

        run_id = f"fuzz-{uuid.uuid4().hex[:6]}"
        hosted = []
        for stage in range(cfg.model.num_stages):
            server = StageServer(node())
            loop.run(server.start())
            servers.append(server)
            hosted.append(server.host(HostedStage(server.node, run_id, cfg, stage)))
            loop.run(server.announcer.announce_now())
        trainer = node(client=True)
        senders = Senders(*(node(client=True) for _ in range(4)))  # stranger, member, vandal, status reader
        data = build_data(cfg)
        pipeline = SwarmPipeline(trainer, loop, cfg, run_id)
        pipeline.setup(Schedule.of(cfg, len(data[0]), steps).lr_horizon, len(data[0]), wait_s=30)
        targets = targets_of(hosted, pipeline, senders.stranger.peer_id, senders.member.peer_id)
        limit = SETTINGS.streams.read_timeout_s + SETTINGS.streams.drain_s + 10
        plan = Plan(count, limit, limit, seed=seed)
        floods = f"{len(FLOODS) * plan.floods} floods of 2 MiB held open at each"
        say(f"{len(hosted)} stage peers training {steps} steps; {count} malformed messages and {floods} on their way")
        rss = max_rss_mib()
        running = asyncio.run_coroutine_threadsafe(campaign(senders, targets, plan, Served(servers)), loop.loop)
        results = ResultsWriter(None)
        train(cfg, pipeline, data, results, steps, progress=False)
        tally = running.result()
        memory = max_rss_mib() - rss
        serving = all(h.runtime is not None and h.role == "serving" for h in hosted)
    finally:
        for server in servers:
            loop.run(server.stop())
        for created in reversed(nodes):
            loop.run(created.shutdown())
        loop.stop()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "local.jsonl"
        run_experiment(cfg, path, steps, progress=False)
        local = _losses(read_results(path))
    ours = _losses(results.rows)
    diff = max((abs(a - b) / abs(b) for a, b in zip(ours, local, strict=True)), default=0.0)
    if len(ours) != len(local):
        diff = float("inf")
    return FuzzReport(tally, len(ours), diff, memory, serving)


def format_report(report: FuzzReport) -> str:
    t = report.tally
    lines = [
        t.table(),
        f"messages: {t.total}; hung: {t.of('hung')}; multi-line errors: {t.of('multi-line')}; "
        f"answered: {dict(t.answered_kinds) or 'none'} (status calls are public)",
        f"slowest answer: {t.slowest_s:.1f}s (a stalled stream waits read_timeout_s)",
        t.cpu_table(),
        f"status calls during the floods: {len(t.info_s)}, answered within {_slowest(t.info_s)}",
        f"run: {report.steps} steps, largest relative loss difference to one process {report.max_loss_diff:.2e}; "
        f"every stage peer still serving: {'yes' if report.serving else 'NO'}",
        f"peak memory of the swarm's process grew {report.memory_mib:.0f} MiB during the campaign",
    ]
    return "\n".join(lines)


def _slowest(seconds: list) -> str:
    if None in seconds:
        return f"their limit but {seconds.count(None)} (failed)"
    return f"{max(seconds, default=0.0):.3f}s at worst"
