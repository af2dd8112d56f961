"""What a lab's links and the machine's cores did during a run, from the kernel's own counters.

The engine counts the payload it sends; a link carries more: TCP/IP and Ethernet headers, libp2p
framing and encryption, ACKs for what flows the other way, DHT and status traffic. tbf meters all
of it. `CounterSampler` samples every process's link byte counters (`link_bytes`, what
`NetLab.link_bytes` reads), the machine's busy CPU time (/proc/stat) and each lab process's CPU
time and its p2p daemon's (`GroupCpu`) every `every_s` seconds while a lab runs, and `window()`
interpolates them between two instants (say, the ends of the first and last measured steps).

    link_bytes(bridge_ns, links) -> {name: (sent, received)}   bytes each link carried so far
    sampler = CounterSampler(net.link_bytes, GroupCpu(lambda: {name: pgid}))
    while running: sampler.poll(); ...       # samples when `every_s` has passed
    row = sampler.to_row()                 # {"type": "meter", "samples": [...]} for a results file
    window(row, start, end) -> Window(sent={name: bytes}, received={name: bytes}, busy=fraction,
                                      busy_s=seconds, cpu={name: [process s, daemon s]})
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from swarm.netlab.kernel import NetlabError, find_tool, run_tool
from swarm.netlab.links import Link

EVERY_S = 1.0


def link_bytes(bridge_ns: str, links: Mapping[str, Link]) -> dict[str, tuple[int, int]]:
    """{name: (bytes it sent, bytes it received)} over each lab link so far. A shaped direction
    reports what its qdisc metered (every frame after segmentation: headers and ACKs included); an
    unshaped one the bridge port's counters (which count a segmentation-offloaded burst's headers
    once)."""
    ip, tc_tool = find_tool("ip") or "ip", find_tool("tc") or "tc"
    ports = {
        entry["ifname"].split("@")[0]: entry.get("stats64", {})
        for entry in _json(run_tool([ip, "-n", bridge_ns, "-s", "-j", "link", "show"]).stdout)
    }
    down_qdiscs = _root_qdisc_bytes(run_tool([tc_tool, "-n", bridge_ns, "-s", "-j", "qdisc", "show"]).stdout)
    counts = {}
    for name, link in links.items():
        port, device = link.down.device, link.up.device  # the bridge port receives what the process sends
        stats = ports.get(port, {})
        sent, received = int(stats.get("rx", {}).get("bytes", 0)), int(stats.get("tx", {}).get("bytes", 0))
        if link.up.qdisc is not None:
            shown = run_tool([tc_tool, "-n", link.netns, "-s", "-j", "qdisc", "show", "dev", device]).stdout
            sent = _root_qdisc_bytes(shown, device).get(device, sent)
        if link.down.qdisc is not None:
            received = down_qdiscs.get(port, received)
        counts[name] = (sent, received)
    return counts


def _json(text: str) -> list[dict]:
    try:
        return json.loads(text or "[]")
    except json.JSONDecodeError as e:
        raise NetlabError(f"iproute2 printed no JSON ({e}): it needs -j support (iproute2 >= 4.13)") from None


def _root_qdisc_bytes(text: str, device: str | None = None) -> dict[str, int]:
    """{device: bytes its root qdisc sent} from `tc -s -j qdisc show [dev DEVICE]` (which leaves
    the device out of its entries when it was named)."""
    return {q.get("dev", device): int(q.get("bytes", 0)) for q in _json(text) if q.get("root")}


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core since boot, from /proc/stat (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already inside user and nice
    return (total - idle) / ticks, total / ticks


def proc_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, name, the fields after the name) of each process's /proc/<pid>/stat: state, ppid, pgrp,
    ..., utime and stime 12th and 13th (the name may hold spaces and parentheses); processes that
    exit meanwhile are left out."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(entry.name), stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


class GroupCpu:
    """CPU seconds so far (user and system) of named process groups, each as [its processes but the
    daemon, its p2p daemon]: a lab starts every peer as a group leader, and hivemind starts the
    peer's p2pd in that group. A process that has exited keeps the time it had when last read
    (its /proc entry is gone by then), so totals only grow while every process is read now and then."""

    def __init__(self, groups: Callable[[], dict[str, int]], daemon: str = "p2pd") -> None:
        self.groups, self.daemon = groups, daemon  # groups: {name: process group id}, read at every call
        self._seen: dict[int, tuple[int, bool, float]] = {}  # pid -> (group, is the daemon, CPU seconds)

    def __call__(self) -> dict[str, list[float]]:
        groups = self.groups()
        names = {pgid: name for name, pgid in groups.items()}
        ticks = os.sysconf("SC_CLK_TCK")
        for pid, comm, fields in proc_stats():
            if int(fields[2]) in names:
                self._seen[pid] = (int(fields[2]), comm == self.daemon, (int(fields[11]) + int(fields[12])) / ticks)
        cpu = {name: [0.0, 0.0] for name in groups}
        for pgid, is_daemon, seconds in self._seen.values():
            if pgid in names:
                cpu[names[pgid]][is_daemon] += seconds
        return cpu


class CounterSampler:
    def __init__(
        self,
        read_links: Callable[[], dict[str, tuple[int, int]]],
        read_cpu: Callable[[], dict[str, list[float]]] | None = None,
        every_s: float = EVERY_S,
    ) -> None:
        self.read_links, self.read_cpu = read_links, read_cpu  # read_cpu: a GroupCpu of the lab's processes
        self.every_s = every_s
        self.samples: list[dict] = []

    def poll(self) -> None:
        """Takes a sample if `every_s` has passed since the last one."""
        if not self.samples or time.time() - self.samples[-1]["at"] >= self.every_s:
            self.sample()

    def sample(self) -> None:
        began = time.time()
        links = self.read_links()
        busy, total = machine_cpu_s()
        sample = {"links": {name: list(pair) for name, pair in links.items()}, "cpu_busy_s": busy, "cpu_total_s": total}
        if self.read_cpu is not None:
            sample["cpu"] = self.read_cpu()  # reads all of /proc: the slow part, hence the stamp mid-sample
        self.samples.append({"at": (began + time.time()) / 2, **sample})

    def to_row(self) -> dict:
        return {"type": "meter", "every_s": self.every_s, "samples": self.samples}


@dataclass(frozen=True)
class Window:
    sent: dict[str, float]  # bytes each process's link carried out of it between the two instants
    received: dict[str, float]
    busy: float  # fraction of the machine's CPU time that was busy
    busy_s: float  # the machine's busy CPU seconds (all cores)
    cpu: dict[str, list[float]]  # CPU seconds of each lab process and of its p2p daemon ({} if not sampled)


def window(row: dict, start: float, end: float) -> Window:
    """The counters' growth from `start` to `end` (unix times), linearly interpolated between samples.
    ValueError when the samples do not cover the window."""
    samples = row["samples"]
    if end <= start:
        raise ValueError(f"empty window: {start} to {end}")
    if len(samples) < 2 or samples[0]["at"] > start or samples[-1]["at"] < end:
        span = f"{samples[0]['at']:.1f} to {samples[-1]['at']:.1f}" if samples else "nothing"
        raise ValueError(f"the meter's samples ({span}) do not cover {start:.1f} to {end:.1f}")

    def at(t: float, value: Callable[[dict], float]) -> float:
        for before, after in zip(samples, samples[1:], strict=False):
            if before["at"] <= t <= after["at"]:
                share = (t - before["at"]) / (after["at"] - before["at"]) if after["at"] > before["at"] else 0.0
                return value(before) + share * (value(after) - value(before))
        raise AssertionError("unreachable: the window is covered")

    def growth(value: Callable[[dict], float]) -> float:
        return at(end, value) - at(start, value)

    names = samples[0]["links"]
    sent = {name: growth(lambda s, n=name: s["links"][n][0]) for name in names}
    received = {name: growth(lambda s, n=name: s["links"][n][1]) for name in names}
    total = growth(lambda s: s["cpu_total_s"])
    busy_s = growth(lambda s: s["cpu_busy_s"])
    busy = busy_s / total if total > 0 else float("nan")
    cpu = {}
    if all("cpu" in s for s in samples):
        for name in samples[-1]["cpu"]:  # a process that started later counts from zero before it did
            cpu[name] = [growth(lambda s, n=name, i=i: s["cpu"].get(n, (0.0, 0.0))[i]) for i in (0, 1)]
    return Window(sent, received, busy, busy_s, cpu)
