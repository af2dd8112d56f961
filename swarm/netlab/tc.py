"""The tc commands that shape one interface's egress, as argv lists (pure: nothing is run here).

One source of truth for the namespace lab (swarm.netlab.namespaces), the Docker entrypoint
(`python -m swarm.netlab shape`) and the tests:

    egress_commands(dev, rate_bits, delay_s=0.0, netem=False, netns=None) -> list[list[str]]
    tbf_params(rate_bits, mtu=1500) -> TbfParams(burst_bytes, limit_bytes)
    netem_limit_packets(rate_bits, delay_s, mtu=1500) -> int
    clear_commands(dev, netns=None) -> list[list[str]]
    ingress_commands(dev, ifb, rate_bits, netns=None) -> list[list[str]]   (needs ifb, u32, mirred)

Choice of qdisc: with a delay and a kernel that has netem, one `netem rate R delay D` qdisc does
both; otherwise `tbf` does the rate (and the delay is left to the caller: see
swarm.netlab.shaper). tbf sizes: the bucket (burst) holds ~4 ms of traffic but at least 4 full
frames, because a smaller bucket cannot reach the rate with a kernel timer slack of a few ms; the
queue (limit) holds ~25 ms of traffic on top of the bucket but at least 64 KiB, enough for TCP to
keep the link busy without adding much queueing delay to the RPCs that share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.rates import format_delay

BURST_SECONDS = 0.004
QUEUE_SECONDS = 0.025
MIN_LIMIT_BYTES = 64 * 1024


@dataclass(frozen=True)
class TbfParams:
    burst_bytes: int
    limit_bytes: int


def tbf_params(rate_bits: int, mtu: int = 1500) -> TbfParams:
    rate_bytes = rate_bits / 8
    burst = max(4 * (mtu + 14), int(math.ceil(rate_bytes * BURST_SECONDS)))
    limit = max(MIN_LIMIT_BYTES, burst + int(math.ceil(rate_bytes * QUEUE_SECONDS)))
    return TbfParams(burst, limit)


def netem_limit_packets(rate_bits: int, delay_s: float, mtu: int = 1500) -> int:
    """Packets netem may hold: everything in flight during the delay plus the tbf-like queue, x2 for slack."""
    in_flight = rate_bits / 8 * (delay_s + QUEUE_SECONDS) / (mtu + 14)
    return max(1000, int(math.ceil(2 * in_flight)))


def _tc(netns: str | None) -> list[str]:
    return ["tc", "-n", netns] if netns else ["tc"]


def egress_commands(
    dev: str,
    rate_bits: int | None,
    delay_s: float = 0.0,
    netem: bool = False,
    netns: str | None = None,
    mtu: int = 1500,
) -> list[list[str]]:
    """Commands that make `dev`'s egress `rate_bits` (None: unlimited) with `delay_s` one-way delay.

    The delay is only in the commands when `netem` is True (the kernel has it); callers check
    `delay_applied(delay_s, netem)` and fall back to an in-process delay otherwise.
    """
    if delay_s > 0 and netem:
        args = ["netem", "delay", format_delay(delay_s)]
        if rate_bits is not None:
            args += ["rate", f"{rate_bits}bit"]
        args += ["limit", str(netem_limit_packets(rate_bits or 10**10, delay_s, mtu))]
        return [[*_tc(netns), "qdisc", "replace", "dev", dev, "root", *args]]
    if rate_bits is None:
        return []
    return [_tbf_command(dev, rate_bits, netns, mtu)]


def _tbf_command(dev: str, rate_bits: int, netns: str | None, mtu: int) -> list[str]:
    """tbf at `rate_bits` as the root qdisc of `dev` (burst and queue from `tbf_params`)."""
    p = tbf_params(rate_bits, mtu)
    limits = ["rate", f"{rate_bits}bit", "burst", str(p.burst_bytes), "limit", str(p.limit_bytes)]
    return [*_tc(netns), "qdisc", "replace", "dev", dev, "root", "tbf", *limits]


def qdisc_kind(rate_bits: int | None, delay_s: float, netem: bool) -> str | None:
    """Which qdisc egress_commands installs: 'netem', 'tbf' or None (nothing to do)."""
    if delay_s > 0 and netem:
        return "netem"
    return "tbf" if rate_bits is not None else None


def delay_applied(delay_s: float, netem: bool) -> bool:
    return delay_s > 0 and netem


def clear_commands(dev: str, netns: str | None = None) -> list[list[str]]:
    return [[*_tc(netns), "qdisc", "del", "dev", dev, "root"]]


def ingress_commands(dev: str, ifb: str, rate_bits: int, netns: str | None = None, mtu: int = 1500) -> list[list[str]]:
    """Shapes what `dev` receives: redirect its ingress to an ifb device and put tbf on that's egress.

    For a host or container that can only touch its own interface (Docker); NetLab does not need
    it, because there the bridge side of each veth is the process's download direction.
    """
    ip = ["ip", "-n", netns] if netns else ["ip"]
    return [
        [*ip, "link", "add", ifb, "type", "ifb"],
        [*ip, "link", "set", ifb, "up"],
        [*_tc(netns), "qdisc", "replace", "dev", dev, "handle", "ffff:", "ingress"],
        [
            *_tc(netns),
            "filter",
            "replace",
            "dev",
            dev,
            "parent",
            "ffff:",
            "protocol",
            "all",
            "prio",
            "1",
            "u32",
            "match",
            "u32",
            "0",
            "0",
            "action",
            "mirred",
            "egress",
            "redirect",
            "dev",
            ifb,
        ],
        _tbf_command(ifb, rate_bits, netns, mtu),
    ]
