"""One Linux network namespace per process, joined through a bridge, each link rate limited by tc.

    with NetLab(["bootstrap", "stage0", "stage1", "trainer"], rates={"stage1": "20mbit"}, delays="10ms") as net:
        print(net.summary())                      # what was applied, one line per link
        argv = net.wrap("stage1", [sys.executable, "-m", "peers.stage", "--stage", "1",
                                   "--host_maddrs", net.maddr("stage1"), ...])
        subprocess.Popen(argv, start_new_session=True)      # runs inside stage1's namespace
        ...
    # every namespace is gone here: on normal exit, on an exception, on SIGINT and SIGTERM

Topology. Each name gets a namespace `<tag>-<name>` (tag = `hp-<owner pid>-<4 hex>`) with `lo` up
and one veth `eth0` holding an address from `subnet` (10.77.0.2, .3, ... in the order given). The
other veth ends are ports of a bridge `br0` that lives in its own namespace `<tag>--bridge`, so
nothing is created in, or routed through, the host's network: two labs (or two test runs) can use
the same subnet at the same time. Processes in different namespaces reach each other only by the
addresses of `eth0` (`net.address(name)`, `net.maddr(name, port)`); loopback stays private.

Shaping. A name's link is its access link, like a home connection: `up` is the egress of its
`eth0` (what the process sends), `down` is the egress of its bridge port (what it receives). Both
directions get the link's rate, and they do not share it (full duplex). A transfer from A to B
crosses A's up and B's down, so it runs at min(rate A, rate B). The qdisc is tbf for the rate;
with a delay and a kernel that has netem, the up direction is one `netem delay D rate R` qdisc
instead. The delay is one-way and only on `up`, so A->B takes delay(A), and an RTT between A and B
is delay(A) + delay(B). Without netem the delay cannot be applied: the link reports
`delay_applied=False` and `net.missing_delay(name)` says how much the caller must add on that
process's send path (swarm.netlab.shaper.TokenBucket(..., delay_s=...)); `require_delay=True`
turns that into a NetlabError instead.

API (detect, require, cleanup_stale, list_namespaces and the errors are swarm.netlab.kernel's,
importable from here too)
    detect(refresh=False) -> Capabilities       root/ip/tc/netns/veth/bridge/tbf/netem/ifb, probed
                                                  once per process in a throwaway namespace
    require() -> Capabilities                   or NetlabError (one line) when namespaces can't work
    NetLab(names, rates=None, delays=None, *, nat=(), options=LabOptions())
    LabOptions(subnet="10.77.0.0/24", prefix="hp", require_delay=False, handle_signals=True, mtu=1500, grace=2.0)
        nat: names put each behind its own NAT router (swarm.netlab.nat): they dial out, nobody dials in
        rates/delays: None (unshaped), one value for every link, or {name: value}
        (rates: '100mbit', 5e6, ... see swarm.rates; delays: '20ms', 0.02, ...)
        .start() / .close()  (or `with`)       .links -> {name: Link}
        .topology -> Topology                  names, addresses, the namespaces' tag and the bridge's
        .namespace(name) .address(name) .public_address(name) .maddr(name, port=0) .wrap(name, argv)
        .namespaces()
        .missing_delay(name) -> float   .summary() -> str
        .link_bytes() -> {name: (sent, received)}   bytes each link carried so far (kernel counters)
    Link / Direction (swarm.netlab.links): what each link's qdiscs enforce, delay requested/applied
    cleanup_stale(prefix="hp") -> [deleted namespaces]    leftovers whose owner pid is dead
    list_namespaces(prefix=None) -> [names]
    NetlabError(RuntimeError): one-line, user-facing; NetlabInterrupted(KeyboardInterrupt)

Signals. While a lab is up (and started from the main thread), SIGTERM and SIGHUP raise
NetlabInterrupted (a KeyboardInterrupt, so code that already stops cleanly on Ctrl-C does the
same); leaving the `with` tears everything down and then hands the signal on to whatever was
installed before, so the process still ends "killed by SIGTERM" (swarm.netlab.signals). SIGINT
keeps Python's KeyboardInterrupt. A signal that arrives during teardown waits until teardown is
done. An atexit hook is the last resort; a SIGKILLed owner leaves namespaces behind, which
`cleanup_stale()` removes (NetLab.start() calls it first).

Teardown kills what still runs inside the namespaces (SIGTERM, then SIGKILL after `grace`
seconds), then deletes them; deleting the bridge's namespace removes every veth.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.netlab.counters import link_bytes
from swarm.netlab.kernel import (
    PREFIX,
    Capabilities,
    NetlabError,
    NetlabInterrupted,
    cleanup_stale,
    destroy_namespaces,
    detect,
    find_tool,
    list_namespaces,
    require,
    run_tool,
)
from swarm.netlab.links import Link, shape_direction
from swarm.netlab.nat import ROUTER_SUFFIX, build_router, private_subnet, require_iptables
from swarm.netlab.signals import SignalRelay, pass_on
from swarm.rates import parse_delay, parse_rate

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]{0,31}")


def _per_name(kind: str, value: Any, names: Sequence[str], parse) -> dict[str, Any]:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(
                f"{kind} given for unknown link(s) {', '.join(map(str, unknown))}; links are {', '.join(names)}"
            )
        return {n: (None if value.get(n) is None else parse(value[n])) for n in names}
    parsed = None if value is None else parse(value)
    return dict.fromkeys(names, parsed)


# ---------------------------------------------------------------------------------------- the lab


class Topology:
    """Who lives where: each process's namespace and address on the subnet, and the bridge's
    namespace, all named after one tag unique to this lab (validated; nothing is created here)."""

    def __init__(self, names: Sequence[str], subnet: str, prefix: str) -> None:
        names = list(names)
        if not names:
            raise ValueError("a NetLab needs at least one process name")
        for name in names:
            if not _NAME.fullmatch(str(name)):
                raise ValueError(f"bad process name {name!r}: use letters, digits, '_' and '.', at most 32 characters")
        if len(set(names)) != len(names):
            raise ValueError(f"process names repeat: {names}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError(f"bad prefix {prefix!r}: 1-8 lowercase letters/digits, starting with a letter")
        try:
            network = ipaddress.ip_network(subnet)
        except ValueError as e:
            raise ValueError(f"bad subnet {subnet!r}: {e}") from None
        hosts = list(network.hosts()) if network.num_addresses <= 65536 else []
        if network.version != 4 or len(hosts) < len(names) + 1:
            raise ValueError(
                f"subnet {subnet} is too small for {len(names)} processes (IPv4, one address each plus one spare)"
            )
        self.names = names
        self.network = network
        self.addresses = {name: str(hosts[i + 1]) for i, name in enumerate(names)}  # .1 stays free
        self.prefix = prefix  # cleanup_stale() finds dead owners' namespaces by it
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"  # two labs of one owner never collide
        self.bridge_ns = f"{self.tag}--bridge"

    def namespace(self, name: str) -> str:
        self.check(name)
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        self.check(name)
        return self.addresses[name]

    def check(self, name: str) -> None:
        if name not in self.addresses:
            raise KeyError(f"no process {name!r} in this lab; known: {', '.join(self.names)}")


@dataclass(frozen=True)
class LabOptions:
    """How a lab is built and run: its bridge's subnet, the prefix of its namespaces' names, whether
    a delay the kernel cannot apply is an error, whether SIGTERM and SIGHUP end it cleanly, its links'
    MTU, and the seconds its processes get between SIGTERM and SIGKILL at teardown."""

    subnet: str = "10.77.0.0/24"
    prefix: str = PREFIX
    require_delay: bool = False
    handle_signals: bool = True
    mtu: int = 1500
    grace: float = 2.0


class NetLab:
    """Namespaces, veths, a bridge and tc shaping for a set of named processes (see module doc)."""

    def __init__(
        self,
        names: Sequence[str],
        rates: str | int | float | Mapping[str, Any] | None = None,
        delays: str | int | float | Mapping[str, Any] | None = None,
        *,
        nat: Sequence[str] = (),
        options: LabOptions = LabOptions(),
    ) -> None:
        self.topology = Topology(names, options.subnet, options.prefix)
        names = self.topology.names
        unknown = sorted(set(nat) - set(names))
        if unknown:
            raise ValueError(f"behind NAT: unknown process(es) {', '.join(unknown)}; processes are {', '.join(names)}")
        self.nat = [name for name in names if name in set(nat)]  # each behind its own router (swarm.netlab.nat)
        self.rates: dict[str, int | None] = _per_name("rate", rates, names, parse_rate)
        self.delays: dict[str, float] = {n: d or 0.0 for n, d in _per_name("delay", delays, names, parse_delay).items()}
        self.require_delay, self.handle_signals = options.require_delay, options.handle_signals
        self.mtu, self.grace = options.mtu, options.grace
        self.links: dict[str, Link] = {}
        self.capabilities: Capabilities | None = None
        self._owner = os.getpid()
        self._state = "new"  # new -> up -> closing -> closed
        self._signals = SignalRelay()

    # ---------------------------------------------------------------- names and commands

    def namespace(self, name: str) -> str:
        return self.topology.namespace(name)

    def address(self, name: str) -> str:
        """The address `name`'s process has (behind NAT: its private one, which only its router reaches)."""
        if name in self.nat:
            return private_subnet(self.nat.index(name))[1]
        return self.topology.address(name)

    def public_address(self, name: str) -> str:
        """The address others see `name` at on the bridge (behind NAT: its router's)."""
        return self.topology.address(name)

    def maddr(self, name: str, port: int = 0) -> str:
        """The multiaddr a process in `name` should listen on: /ip4/<its address>/tcp/<port>."""
        return f"/ip4/{self.address(name)}/tcp/{port}"

    def wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `name`'s namespace: ['ip', 'netns', 'exec', <namespace>, *argv]."""
        return [find_tool("ip") or "ip", "netns", "exec", self.namespace(name), *argv]

    def missing_delay(self, name: str) -> float:
        """Seconds of one-way delay the kernel could not apply to `name`'s link (add it in-process)."""
        self.topology.check(name)
        link = self.links.get(name)
        return link.missing_delay_s if link else self.delays[name]

    def namespaces(self) -> list[str]:
        """This lab's namespaces that exist right now (empty after close)."""
        return list_namespaces(self.topology.tag + "-")

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        if isinstance(exc, NetlabInterrupted):
            pass_on(exc)
        return False

    def start(self) -> NetLab:
        if self._state != "new":
            raise RuntimeError("a NetLab starts once")
        self.capabilities = require()
        if self.require_delay and any(self.delays.values()) and not self.capabilities.netem:
            raise NetlabError(
                "link delays need netem, which this kernel lacks: use in-process delays (swarm.netlab.shaper)"
            )
        cleanup_stale(self.topology.prefix)
        self._state = "up"
        if self.handle_signals:
            self._signals.install()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, NetlabInterrupted):
                pass_on(e)
            raise
        return self

    def _build(self) -> None:
        ip, br, topology = find_tool("ip") or "ip", self.topology.bridge_ns, self.topology
        netem = bool(self.capabilities and self.capabilities.netem)
        run_tool([ip, "netns", "add", br])
        run_tool([ip, "-n", br, "link", "set", "lo", "up"])
        run_tool([ip, "-n", br, "link", "add", "br0", "type", "bridge"])
        run_tool([ip, "-n", br, "link", "set", "br0", "up"])
        if self.nat:
            require_iptables()
        for i, name in enumerate(topology.names):
            ns, port = topology.namespace(name), f"v{i}"
            run_tool([ip, "netns", "add", ns])
            run_tool([ip, "-n", ns, "link", "set", "lo", "up"])
            edge = ns  # the namespace whose eth0 is on the bridge: the process's, or its router's
            if name in self.nat:
                edge = ns + ROUTER_SUFFIX
                build_router(ns, edge, self.nat.index(name), self.mtu)
            veth = ["link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name", "eth0", "netns", edge]
            run_tool([ip, "-n", br, *veth])
            run_tool([ip, "-n", br, "link", "set", port, "master", "br0", "up"])
            address = topology.address(name)
            run_tool([ip, "-n", edge, "addr", "add", f"{address}/{topology.network.prefixlen}", "dev", "eth0"])
            run_tool([ip, "-n", edge, "link", "set", "eth0", "mtu", str(self.mtu), "up"])
            rate, delay = self.rates[name], self.delays[name]
            up = shape_direction("up", edge, "eth0", rate, delay, netem, self.mtu)
            down = shape_direction("down", br, port, rate, 0.0, netem, self.mtu)
            self.links[name] = Link(name, edge, address, rate, delay, up, down)

    def close(self) -> None:
        """Tears everything down (idempotent; safe from atexit and after a partial start)."""
        if self._state in ("new", "closing", "closed") or os.getpid() != self._owner:
            return
        self._state = "closing"
        self._signals.hold()
        try:
            destroy_namespaces(self.namespaces(), grace=self.grace)
        finally:
            self._state = "closed"
            atexit.unregister(self.close)
            self._signals.release()

    # ---------------------------------------------------------------- reporting

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """{name: (bytes it sent, bytes it received)} over its link so far (swarm.netlab.counters)."""
        if self._state != "up":
            raise NetlabError("the lab is not up: no link counters to read")
        return link_bytes(self.topology.bridge_ns, {name: self.links[name] for name in self.topology.names})

    def summary(self) -> str:
        caps, topology = self.capabilities or detect(), self.topology
        lines = [
            f"netlab {topology.tag}: {len(topology.names)} namespaces on {topology.network} (bridge in {topology.bridge_ns}); {caps.summary()}"
        ]
        lines += [f"  {self.links[n].describe()}" for n in topology.names if n in self.links]
        lines += [
            f"  {n} is behind NAT at {self.address(n)}: its router {topology.address(n)} lets nobody dial in"
            for n in self.nat
        ]
        return "\n".join(lines)
