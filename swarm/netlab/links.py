"""A lab process's access link as shaped: both directions' qdiscs, what they enforce, and what
could not be applied (a delay without netem), so a caller knows what is left to do in process.

    shape_direction("up", netns, "eth0", rate_bits, delay_s, netem, mtu) -> Direction   runs tc
    Link(name, netns, address, rate_bits, delay_s, up, down)   .missing_delay_s   .describe()
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.netlab import tc
from swarm.netlab.kernel import find_tool, run_tool
from swarm.rates import format_delay, format_rate


@dataclass(frozen=True)
class Direction:
    """One direction of one link: the qdisc on the egress of `device` in namespace `netns`."""

    direction: str  # "up" (the process sends) or "down" (it receives)
    netns: str
    device: str
    qdisc: str | None  # "tbf", "netem" or None (unshaped)
    rate_bits: int | None
    burst_bytes: int | None
    limit: int | None  # bytes for tbf, packets for netem
    delay_s: float  # requested one-way delay on this direction
    delay_applied: bool

    def describe(self) -> str:
        if self.qdisc is None:
            return f"{self.direction} unshaped"
        text = f"{self.direction} {self.qdisc} {format_rate(self.rate_bits) if self.rate_bits else 'no rate limit'}"
        if self.qdisc == "tbf":
            text += f" burst {self.burst_bytes}B limit {self.limit}B"
        if self.delay_applied:
            text += f" delay {format_delay(self.delay_s)}"
        return text


@dataclass(frozen=True)
class Link:
    """A process's access link: its namespace, address and both shaped directions."""

    name: str
    netns: str
    address: str
    rate_bits: int | None
    delay_s: float
    up: Direction
    down: Direction

    @property
    def delay_applied(self) -> bool:
        return self.delay_s == 0 or self.up.delay_applied

    @property
    def missing_delay_s(self) -> float:
        """One-way delay the caller must add in-process on this process's send path."""
        return 0.0 if self.delay_applied else self.delay_s

    def describe(self) -> str:
        text = f"{self.name:<10} {self.address:<15} {self.up.describe()}; {self.down.describe()}"
        if self.delay_s and not self.delay_applied:
            text += f"; delay {format_delay(self.delay_s)} NOT applied (no netem): add it in-process"
        return text


def shape_direction(
    direction: str, netns: str, device: str, rate_bits: int | None, delay_s: float, netem: bool, mtu: int
) -> Direction:
    """Shapes the egress of `device` in `netns` (tc, see swarm.netlab.tc) and says what it applied."""
    for argv in tc.egress_commands(device, rate_bits, delay_s, netem, netns=netns, mtu=mtu):
        run_tool([find_tool("tc") or "tc", *argv[1:]])
    kind = tc.qdisc_kind(rate_bits, delay_s, netem)
    params = tc.tbf_params(rate_bits, mtu) if kind == "tbf" and rate_bits else None
    if params:
        limit = params.limit_bytes
    elif kind == "netem":
        limit = tc.netem_limit_packets(rate_bits or 10**10, delay_s, mtu)
    else:
        limit = None
    return Direction(
        direction,
        netns,
        device,
        kind,
        rate_bits,
        params.burst_bytes if params else None,
        limit,
        delay_s,
        tc.delay_applied(delay_s, netem),
    )
