"""What a lab run will be, checked before any process starts (swarm.lab.launch.Lab runs it).

RunPlan     the swarm: config and overrides, stages and each one's replicas, the processes' names,
            results, steps, the trainer's extra arguments, the churn, the torch threads each
            computing peer gets, the timeline to write (from RunOptions, the options asked for)
LinkPlan    the links: each process's rate, the delay, namespaces or in-process shaping, the probe
            and the peers' own pacing; the command-line arguments each process gets for them (from
            LinkOptions)
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
    """A replica or churn joiner (stage1.2) has its stage's first peer's link."""
    return name.split(".", 1)[0]


@dataclass
class RunOptions:
    """What a lab run is asked for beyond its config and stage count (the command line's options)."""

    results: str | None = None
    steps: int | None = None
    overrides: list[str] = field(default_factory=list)
    device: str | None = None
    trainer_args: list[str] = field(default_factory=list)  # e.g. --checkpoint_dir DIR
    churn: str | None = None
    trace: str | None = None  # the run's timeline (every peer's, merged: swarm.timeline)
    replicas: str | None = None  # peers per stage from the start: N, or STAGE=N,... (parse_replicas)


@dataclass
class RunPlan:
    """The swarm a lab runs: a bootstrap, `stages` stage peers and a trainer (`names`), on `config`;
    a stage with replicas has more peers from the start (`replica_names`: stage1.2, stage1.3, ...)."""

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
    replicas: dict[int, int] = field(default_factory=dict)  # stage -> its peers from the start

    @classmethod
    def of(cls, config: str, stages: int, options: RunOptions) -> RunPlan:
        """ValueError (one line; ChurnError for a churn) for replicas or a churn that do not parse."""
        replicas = parse_replicas(options.replicas, stages)
        device = options.device
        return cls(
            config,
            stages,
            ["bootstrap", *(f"stage{i}" for i in range(stages)), "trainer"],
            peer_threads(sum(replicas.values()) + 1),  # every stage peer and the trainer compute
            [*options.overrides, f"model.num_stages={stages}", *([f"device={device}"] if device else [])],
            options.results,
            options.steps,
            device,
            list(options.trainer_args),
            Churn.parse(options.churn, stages) if options.churn else None,
            options.trace,
            replicas,
        )

    def replica_names(self) -> list[tuple[int, str]]:
        """(stage, name) of every stage peer beyond each stage's first, started with it."""
        return [(s, f"stage{s}.{k}") for s, count in self.replicas.items() for k in range(2, count + 1)]

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
class LinkOptions:
    """How a lab run's links are asked to be: --bandwidth, --delay, --shaping, the probe, the
    peers' pacing and who is behind NAT (--nat)."""

    bandwidth: str | None = None
    delay: str | None = None
    shaping: str | None = None
    probe: bool = True
    pacing: bool = True
    nat: str | None = None


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
    def of(cls, names: list[str], options: LinkOptions) -> LinkPlan:
        """ValueError (one line) for a rate, delay or shaping that does not parse; namespaces by
        default as root. `names`: the processes --bandwidth may name (a stage's replicas and
        joiners have its first peer's rate)."""
        rates = parse_rates(options.bandwidth, names)
        if options.delay is not None:
            parse_delay(options.delay)
        shaping = options.shaping
        if shaping is not None and shaping not in SHAPINGS:
            raise ValueError(f"--shaping must be one of {', '.join(SHAPINGS)}, got {shaping!r}")
        shaping = shaping or ("netns" if os.geteuid() == 0 else "inprocess")
        return cls(rates, options.delay, shaping, options.probe, options.pacing)

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


_REPLICAS_FORM = "--replicas takes a count for every stage (3) or STAGE=COUNT pairs (1=3,2=2)"


def parse_replicas(spec: str | None, stages: int) -> dict[int, int]:
    """`--replicas 3` -> every stage 3 peers; `1=3,2=2` -> those stages, the others one. ValueError
    (one line) for a count below 1, a stage the run does not have, or anything else."""
    counts = dict.fromkeys(range(stages), 1)
    text = (spec or "").strip()
    if not text:
        if spec is not None:
            raise ValueError(f"{_REPLICAS_FORM}, got {spec!r}")
        return counts
    if "=" not in text:
        return dict.fromkeys(range(stages), _replica_count(text, text))
    for item in text.split(","):
        stage, _, count = (part.strip() for part in item.partition("="))
        if not stage.isdigit() or not count:
            raise ValueError(f"{_REPLICAS_FORM}, got {item.strip()!r}")
        if int(stage) >= stages:
            raise ValueError(f"--replicas names stage {int(stage)}, the run has stages 0..{stages - 1}")
        counts[int(stage)] = _replica_count(count, item.strip())
    return counts


def _replica_count(text: str, item: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{_REPLICAS_FORM}, got {item!r}")
    if int(text) < 1:
        raise ValueError(f"--replicas: a stage needs at least one peer, got {item!r}")
    return int(text)
