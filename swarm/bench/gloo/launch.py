"""Every rank of the gloo baseline as a process, on the lab's links (swarm.lab.launch.Lab).

The trainer and each stage get the namespace and access link a hivepipe trainer and stage peer
get (there is no bootstrap: ranks meet at the trainer's address), the same torch threads, and the
delay the kernel could not add, on their send path. Pacing is hivepipe's own, so it is off here:
gloo sends as fast as TCP lets it. Without namespaces, ranks run on loopback unshaped: gloo
cannot be paced from outside, so in-process shaping is refused.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import replace

from swarm.lab.launch import Lab
from swarm.lab.plan import LinkOptions, RunOptions, available_cores

GLOO = "torch:gloo"  # its name among the benchmarks' --codecs
PORT = 29500  # where rank 0 listens inside its own namespace


class GlooLab(Lab):
    stage_peers_limit_in_flight = False  # its ranks have no such limit (swarm.bench.gloo.run)

    def __init__(
        self, config: str, stages: int, run: RunOptions | None = None, links: LinkOptions | None = None, out=None
    ) -> None:
        super().__init__(config, stages, run, replace(links or LinkOptions(), pacing=False), out)
        plan, links = self.run_plan, self.link_plan
        if plan.churn is not None:
            raise ValueError("the gloo baseline has a fixed set of ranks: no churn")
        if any(count > 1 for count in plan.replicas.values()):
            raise ValueError("the gloo baseline has one rank per stage: no replicas")
        if links.shaped and not links.in_namespaces:
            raise ValueError("the gloo baseline runs on shaped links only in namespaces (--shaping netns, as root)")
        plan.names = [name for name in plan.names if name != "bootstrap"]
        links.rates = {name: rate for name, rate in links.rates.items() if name in plan.names} if links.rates else None

    def _start_peers(self, cfg) -> None:
        plan, trainer_ip = self.run_plan, self._host("trainer").split("/")[2]
        port = PORT if self.net is not None else _free_port()
        common = ["--world", str(plan.stages + 1), "--master", f"{trainer_ip}:{port}", "--config", plan.config]
        common += ["--threads", str(plan.threads), *plan.set_args()]
        self.output.say(
            "lab",
            f"torch.distributed gloo: {plan.stages} stage ranks and a trainer; torch threads per rank: {plan.threads} ({available_cores()} cores)",
        )
        self._start("trainer", "swarm.bench.gloo", "--rank", "0", *common, *plan.results_args(), *plan.trainer_args)
        for stage in range(plan.stages):
            self._start(f"stage{stage}", "swarm.bench.gloo", "--rank", str(stage + 1), *common)
        return None

    def _may_exit(self, process: subprocess.Popen) -> bool:
        return process.returncode == 0  # a stage rank ends once the trainer stopped it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
