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

from swarm.lab.launch import Lab, available_cores

GLOO = "torch:gloo"  # its name among the benchmarks' --codecs
PORT = 29500  # where rank 0 listens inside its own namespace


class GlooLab(Lab):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["pacing"] = False
        super().__init__(*args, **kwargs)
        if self.churn is not None:
            raise ValueError("the gloo baseline has a fixed set of ranks: no churn")
        if self.shaped and self.shaping != "netns":
            raise ValueError("the gloo baseline runs on shaped links only in namespaces (--shaping netns, as root)")
        self.names = [name for name in self.names if name != "bootstrap"]
        self.rates = {name: rate for name, rate in self.rates.items() if name in self.names} if self.rates else None

    def _start_peers(self, cfg) -> None:
        trainer_ip = self._host("trainer").split("/")[2]
        port = PORT if self.net is not None else _free_port()
        sets = [arg for item in self.overrides for arg in ("--set", item)]
        common = ["--world", str(self.stages + 1), "--master", f"{trainer_ip}:{port}", "--config", self.config]
        common += ["--threads", str(self.threads), *sets]
        self._print(
            "lab",
            f"torch.distributed gloo: {self.stages} stage ranks and a trainer; torch threads per rank: {self.threads} ({available_cores()} cores)",
        )
        self._start("trainer", "swarm.bench.gloo", "--rank", "0", *common, *self._results_args(), *self.trainer_args)
        for stage in range(self.stages):
            self._start(f"stage{stage}", "swarm.bench.gloo", "--rank", str(stage + 1), *common)
        return None

    def _may_exit(self, process: subprocess.Popen) -> bool:
        return process.returncode == 0  # a stage rank ends once the trainer stopped it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
