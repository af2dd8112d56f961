"""What a lab run will be, checked before any process starts (swarm.lab.launch.Lab runs it).

RunPlan     the swarm: config and overrides, stages, the processes' names, results, steps, the
            trainer's extra arguments, the churn, the torch threads each computing peer gets, the
            timeline to write
LinkPlan    the links: each process's rate, the delay, namespaces or in-process shaping, the probe
            and the peers' own pacing; the command-line arguments each process gets for them
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from swarm.lab.bandwidth import parse_rates
from swarm.lab.churn import Churn
from swarm.rates import parse_delay

SHAPINGS = ("netns", "inprocess")


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def peer_threads(peers: int) -> int:
    """torch threads for each of `peers` computing processes on this machine: a fair share of its cores."""
    return max(1, available_cores() // max(peers, 1))


def base_name(name: str) -> str:
    """A churn joiner (stage1.2) has its stage's first peer's link."""
    return name.split(".", 1)[0]


@dataclass
class RunPlan:
    """The swarm a lab runs: a bootstrap, `stages` stage peers and a trainer (`names`), on `config`."""

    config: str
    stages: int
    names: list[str]
    threads: int  # torch threads per computing peer: its share of this machine's cores
    overrides: list[str] = field(default_factory=list)  # the config's, with the lab's stage count and device
    results: str | None = None
    steps: int | None = None
    device: str | None = None
    trainer_args: list[str] = field(default_factory=list)  # e.g. --checkpoint_dir DIR
    churn: Churn | None = None
    trace: str | None = None  # the run's timeline (every peer's, merged: swarm.timeline)

    @classmethod
    def of(
        cls,
        config: str,
        stages: int,
        threads: int,
        results: str | None = None,
        steps: int | None = None,
        overrides: list[str] | None = None,
        device: str | None = None,
        trainer_args: list[str] | None = None,
        churn: str | None = None,
        trace: str | None = None,
    ) -> RunPlan:
        """ChurnError (one line) for a churn that does not parse."""
        return cls(
            config,
            stages,
            ["bootstrap", *(f"stage{i}" for i in range(stages)), "trainer"],
            threads,
            [*(overrides or []), f"model.num_stages={stages}", *([f"device={device}"] if device else [])],
            results,
            steps,
            device,
            list(trainer_args or []),
            Churn.parse(churn, stages) if churn else None,
            trace,
        )

    def set_args(self) -> list[str]:
        """The overrides as every peer's --set arguments."""
        return [arg for item in self.overrides for arg in ("--set", item)]

    def results_args(self) -> list[str]:
        """Where the trainer writes its results and after how many steps it stops."""
        return [
            *(["--results", str(self.results)] if self.results else []),
            *(["--steps", str(self.steps)] if self.steps else []),
        ]


@dataclass
class LinkPlan:
    """How the lab's links are shaped: `rates` per process name (None: unlimited), the one-way
    `delay`, by what (`shaping`: namespaces and tc, or each process pacing what it sends), whether a
    probe measures the links before the run, and whether peers pace each neighbour flow themselves."""

    rates: dict[str, str] | None
    delay: str | None
    shaping: str  # one of SHAPINGS
    probe: bool = True
    pacing: bool = True

    @classmethod
    def of(
        cls,
        names: list[str],
        bandwidth: str | None = None,
        delay: str | None = None,
        shaping: str | None = None,
        probe: bool = True,
        pacing: bool = True,
    ) -> LinkPlan:
        """ValueError (one line) for a rate, delay or shaping that does not parse; namespaces by default as root."""
        rates = parse_rates(bandwidth, names)
        if delay is not None:
            parse_delay(delay)
        if shaping is not None and shaping not in SHAPINGS:
            raise ValueError(f"--shaping must be one of {', '.join(SHAPINGS)}, got {shaping!r}")
        return cls(rates, delay, shaping or ("netns" if os.geteuid() == 0 else "inprocess"), probe, pacing)

    @property
    def shaped(self) -> bool:
        return bool(self.rates) or bool(self.delay)

    @property
    def in_namespaces(self) -> bool:
        """Each process gets its own namespace and shaped access link (made before the run)."""
        return self.shaped and self.shaping == "netns"

    def rate(self, name: str) -> str | None:
        return (self.rates or {}).get(base_name(name))

    def shape_args(self, name: str, net) -> list[str]:
        """In-process shaping for `name`: all of it (inprocess, `net` None), or the delay netem could
        not apply in `net`'s namespaces."""
        if not self.shaped:
            return []
        if net is not None:
            missing = net.missing_delay(name)
            return ["--shape_delay", f"{missing * 1000:.3f}ms"] if missing > 0 else []
        rate = self.rate(name)
        return (["--shape_rate", rate] if rate else []) + (["--shape_delay", self.delay] if self.delay else [])

    def link_args(self, name: str) -> list[str]:
        """A stage peer's or the trainer's declared link rate (its access link is shaped the same both ways)."""
        rate = self.rate(name)
        if not (self.pacing and rate and (name.startswith("stage") or name == "trainer")):
            return []
        return ["--uplink", rate, "--downlink", rate]

    def describe_inprocess(self) -> str:
        rates = ", ".join(f"{n} {r}" for n, r in (self.rates or {}).items()) or "no rate limit"
        return f"{rates}; delay {self.delay or 'none'} (each process paces what it sends)"


def nat_names(spec: str | None, stages: int) -> list[str]:
    """`--nat 1,2,trainer` -> ["stage1", "stage2", "trainer"] (ValueError, one line, for anything
    else: the bootstrap stays reachable, it is every NATed peer's way in)."""
    names = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item == "trainer":
            names.append("trainer")
        elif item.isdigit() and int(item) < stages:
            names.append(f"stage{int(item)}")
        else:
            raise ValueError(f"--nat takes stage numbers (0..{stages - 1}) and 'trainer', got {item!r}")
    return list(dict.fromkeys(names))
