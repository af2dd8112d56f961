"""What a lab's links and the machine's cores did during a run, from the kernel's own counters.

The engine counts the payload it sends; a link carries more: TCP/IP and Ethernet headers, libp2p
framing and encryption, ACKs for what flows the other way, DHT and status traffic. tbf meters all
of it. `CounterSampler` samples every process's link byte counters (`NetLab.link_bytes`) and the
machine's busy CPU time (/proc/stat) every `every_s` seconds while a lab runs, and `window()`
interpolates them between two instants (say, the ends of the first and last measured steps).

    sampler = CounterSampler(net.link_bytes)
    while running: sampler.poll(); ...       # samples when `every_s` has passed
    row = sampler.to_row()                 # {"type": "meter", "samples": [...]} for a results file
    window(row, start, end) -> Window(sent={name: bytes}, received={name: bytes}, busy=fraction)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

EVERY_S = 1.0


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core since boot, from /proc/stat (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already inside user and nice
    return (total - idle) / ticks, total / ticks


class CounterSampler:
    def __init__(self, read_links: Callable[[], dict[str, tuple[int, int]]], every_s: float = EVERY_S) -> None:
        self.read_links = read_links
        self.every_s = every_s
        self.samples: list[dict] = []

    def poll(self) -> None:
        """Takes a sample if `every_s` has passed since the last one."""
        if not self.samples or time.time() - self.samples[-1]["at"] >= self.every_s:
            self.sample()

    def sample(self) -> None:
        links = self.read_links()
        busy, total = machine_cpu_s()
        self.samples.append({"at": time.time(), "links": {name: list(pair) for name, pair in links.items()}, "cpu_busy_s": busy, "cpu_total_s": total})

    def to_row(self) -> dict:
        return {"type": "meter", "every_s": self.every_s, "samples": self.samples}


@dataclass(frozen=True)
class Window:
    sent: dict[str, float]  # bytes each process's link carried out of it between the two instants
    received: dict[str, float]
    busy: float  # fraction of the machine's CPU time that was busy


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
    busy = growth(lambda s: s["cpu_busy_s"]) / total if total > 0 else float("nan")
    return Window(sent, received, busy)
