"""A swarm on real hivemind in this process (loopback): bootstrap, stage hosts and a trainer node.

Shared by the swarm tests; each test module makes its own (module-scoped) `Swarm`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from swarm.network.hosted import HostedStage
from swarm.network.loop import LoopThread
from swarm.network.node import NodeOptions, SwarmNode
from swarm.network.pipeline import SwarmPipeline
from swarm.network.servicer import StageServicer
from swarm.run import Schedule

HOSTS = 5
SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"  # a 4-stage digits pipeline that runs in seconds


def p2pd_count() -> int:
    out = subprocess.run(["pgrep", "-c", "-x", "p2pd"], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


class Swarm:
    """A bootstrap peer, HOSTS stage hosts (each a P2P daemon + DHT node + servicer) and a trainer."""

    def __init__(self) -> None:
        self.loop = LoopThread("test-swarm")
        self.boot = self.loop.run(SwarmNode.create())
        self.maddrs = self.loop.run(self.boot.maddrs())
        self.hosts: list[tuple[SwarmNode, StageServicer]] = []
        for _ in range(HOSTS):
            node = self.loop.run(SwarmNode.create(NodeOptions(initial_peers=self.maddrs)))
            servicer = StageServicer(node, read_timeout=10, linger_timeout=10)
            self.loop.run(servicer.start())
            self.hosts.append((node, servicer))
        self.trainer = self.loop.run(SwarmNode.create(NodeOptions(initial_peers=self.maddrs, client_mode=True)))

    def host(self, cfg, run_id: str, placement: list[tuple[int, int]]) -> list[HostedStage]:
        """Hosts stage s on host h for every (s, h) and announces at once."""
        hosted = []
        for stage, index in placement:
            node, servicer = self.hosts[index]
            hosted.append(servicer.host(HostedStage(node, run_id, cfg, stage, timeout=30)))
        for _, index in placement:
            self.loop.run(self.hosts[index][1].announcer.announce_now())
        return hosted

    def mortal_host(self, shape_rate: str | None = None) -> tuple[SwarmNode, StageServicer]:
        """A host of its own, for a test to kill or shape (not one of the shared HOSTS)."""
        node = self.loop.run(SwarmNode.create(NodeOptions(initial_peers=self.maddrs, shape_rate=shape_rate)))
        servicer = StageServicer(node)
        self.loop.run(servicer.start())
        return node, servicer

    def unhost(self, run_id: str) -> None:
        for _, servicer in self.hosts:
            for key in [k for k in servicer.hosted if k[0] == run_id]:
                self.loop.run(servicer.unhost(*key))

    def pipeline(self, cfg, run_id: str, steps: int, data) -> SwarmPipeline:
        pipeline = SwarmPipeline(self.trainer, self.loop, cfg, run_id, timeout=30)
        schedule = Schedule.of(cfg, len(data[0]), steps)
        pipeline.setup(schedule.lr_horizon, len(data[0]), wait_s=20)
        return pipeline

    def close(self) -> None:
        for node, servicer in self.hosts:
            self.loop.run(servicer.stop())
            self.loop.run(node.shutdown())
        self.loop.run(self.trainer.shutdown())
        self.loop.run(self.boot.shutdown())
        self.loop.stop()
