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

API
    detect(refresh=False) -> Capabilities       root/ip/tc/netns/veth/bridge/tbf/netem/ifb, probed
                                                  once per process in a throwaway namespace
    require() -> Capabilities                   or NetlabError (one line) when namespaces can't work
    NetLab(names, rates=None, delays=None, *, subnet="10.77.0.0/24", prefix="hp",
           require_delay=False, handle_signals=True, mtu=1500)
        rates/delays: None (unshaped), one value for every link, or {name: value}
        (rates: '100mbit', 5e6, ... see swarm.netlab.rates; delays: '20ms', 0.02, ...)
        .start() / .close()  (or `with`)       .links -> {name: Link}
        .namespace(name) .address(name) .maddr(name, port=0) .wrap(name, argv) .run(name, argv)
        .missing_delay(name) -> float   .summary() -> str   .report() -> dict (JSON-able)
        .link_bytes() -> {name: (sent, received)}   bytes each link carried so far (kernel counters)
    Link / Direction: frozen dataclasses (qdisc kind, rate, burst, limit, delay requested/applied)
    cleanup_stale(prefix="hp") -> [deleted namespaces]    leftovers whose owner pid is dead
    list_namespaces(prefix=None) -> [names]
    NetlabError(RuntimeError): one-line, user-facing; NetlabInterrupted(KeyboardInterrupt)

Signals. While a lab is up (and started from the main thread), SIGTERM and SIGHUP raise
NetlabInterrupted (a KeyboardInterrupt, so code that already stops cleanly on Ctrl-C does the
same); leaving the `with` tears everything down and then hands the signal on to whatever was
installed before: a Python handler is called, the default disposition is re-delivered so the
process still ends "killed by SIGTERM". SIGINT keeps Python's KeyboardInterrupt. A signal that
arrives during teardown waits until teardown is done. An atexit hook is the last resort; a
SIGKILLed owner leaves namespaces behind, which `cleanup_stale()` removes (NetLab.start() calls
it first).

Teardown kills what still runs inside the namespaces (SIGTERM, then SIGKILL after `grace`
seconds), then deletes them; deleting the bridge's namespace removes every veth.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarm.netlab import tc
from swarm.netlab.kernel import (  # noqa: F401 (re-exported: this module is the lab's public face)
    PREFIX,
    Capabilities,
    NetlabError,
    NetlabInterrupted,
    _run,
    _which,
    cleanup_stale,
    destroy_namespaces,
    detect,
    list_namespaces,
    require,
)
from swarm.netlab.rates import format_delay, format_rate, parse_delay, parse_rate

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]{0,31}")


# ------------------------------------------------------------------------------------------ links


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
    commands: tuple[tuple[str, ...], ...]

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

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(delay_applied=self.delay_applied, missing_delay_s=self.missing_delay_s)
        for d in ("up", "down"):
            data[d]["commands"] = [" ".join(c) for c in data[d]["commands"]]
        return data


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


class NetLab:
    """Namespaces, veths, a bridge and tc shaping for a set of named processes (see module doc)."""

    def __init__(
        self,
        names: Sequence[str],
        rates: str | int | float | Mapping[str, Any] | None = None,
        delays: str | int | float | Mapping[str, Any] | None = None,
        *,
        subnet: str = "10.77.0.0/24",
        prefix: str = PREFIX,
        require_delay: bool = False,
        handle_signals: bool = True,
        mtu: int = 1500,
        grace: float = 2.0,
    ) -> None:
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
        self.rates: dict[str, int | None] = _per_name("rate", rates, names, parse_rate)
        self.delays: dict[str, float] = {n: d or 0.0 for n, d in _per_name("delay", delays, names, parse_delay).items()}
        self.network = network
        self.addresses = {name: str(hosts[i + 1]) for i, name in enumerate(names)}  # .1 stays free
        self.prefix, self.require_delay, self.handle_signals, self.mtu, self.grace = (
            prefix,
            require_delay,
            handle_signals,
            mtu,
            grace,
        )
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.tag}--bridge"
        self.links: dict[str, Link] = {}
        self.capabilities: Capabilities | None = None
        self.stale_removed: list[str] = []
        self._owner = os.getpid()
        self._state = "new"  # new -> up -> closing -> closed
        self._previous: dict[int, Any] = {}
        self._pending: int | None = None

    # ---------------------------------------------------------------- names and commands

    def namespace(self, name: str) -> str:
        self._check_name(name)
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        self._check_name(name)
        return self.addresses[name]

    def maddr(self, name: str, port: int = 0) -> str:
        """The multiaddr a process in `name` should listen on: /ip4/<its address>/tcp/<port>."""
        return f"/ip4/{self.address(name)}/tcp/{port}"

    def wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `name`'s namespace: ['ip', 'netns', 'exec', <namespace>, *argv]."""
        return [_which("ip") or "ip", "netns", "exec", self.namespace(name), *argv]

    def run(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(self.wrap(name, argv), **kwargs)."""
        return subprocess.run(self.wrap(name, argv), **kwargs)

    def missing_delay(self, name: str) -> float:
        """Seconds of one-way delay the kernel could not apply to `name`'s link (add it in-process)."""
        self._check_name(name)
        link = self.links.get(name)
        return link.missing_delay_s if link else self.delays[name]

    def namespaces(self) -> list[str]:
        """This lab's namespaces that exist right now (empty after close)."""
        return list_namespaces(self.tag + "-")

    def _check_name(self, name: str) -> None:
        if name not in self.addresses:
            raise KeyError(f"no process {name!r} in this lab; known: {', '.join(self.names)}")

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        if isinstance(exc, NetlabInterrupted):
            _pass_on(exc)
        return False

    def start(self) -> NetLab:
        if self._state != "new":
            raise RuntimeError("a NetLab starts once")
        self.capabilities = require()
        if self.require_delay and any(self.delays.values()) and not self.capabilities.netem:
            raise NetlabError(
                "link delays need netem, which this kernel lacks: use in-process delays (swarm.netlab.shaper)"
            )
        self.stale_removed = cleanup_stale(self.prefix)
        self._state = "up"
        self._install_signals()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, NetlabInterrupted):
                _pass_on(e)
            raise
        return self

    def _build(self) -> None:
        ip, br = _which("ip") or "ip", self.bridge_ns
        netem = bool(self.capabilities and self.capabilities.netem)
        _run([ip, "netns", "add", br])
        _run([ip, "-n", br, "link", "set", "lo", "up"])
        _run([ip, "-n", br, "link", "add", "br0", "type", "bridge"])
        _run([ip, "-n", br, "link", "set", "br0", "up"])
        for i, name in enumerate(self.names):
            ns, port = self.namespace(name), f"v{i}"
            _run([ip, "netns", "add", ns])
            _run([ip, "-n", ns, "link", "set", "lo", "up"])
            _run(
                [
                    ip,
                    "-n",
                    br,
                    "link",
                    "add",
                    port,
                    "mtu",
                    str(self.mtu),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                ]
            )
            _run([ip, "-n", br, "link", "set", port, "master", "br0", "up"])
            _run([ip, "-n", ns, "addr", "add", f"{self.addresses[name]}/{self.network.prefixlen}", "dev", "eth0"])
            _run([ip, "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu), "up"])
            rate, delay = self.rates[name], self.delays[name]
            up = self._shape("up", ns, "eth0", rate, delay, netem)
            down = self._shape("down", br, port, rate, 0.0, netem)
            self.links[name] = Link(name, ns, self.addresses[name], rate, delay, up, down)

    def _shape(self, direction: str, ns: str, dev: str, rate: int | None, delay: float, netem: bool) -> Direction:
        commands = tc.egress_commands(dev, rate, delay, netem, netns=ns, mtu=self.mtu)
        for argv in commands:
            _run([_which("tc") or "tc", *argv[1:]])
        kind = tc.qdisc_kind(rate, delay, netem)
        params = tc.tbf_params(rate, self.mtu) if kind == "tbf" and rate else None
        limit = (
            params.limit_bytes
            if params
            else (tc.netem_limit_packets(rate or 10**10, delay, self.mtu) if kind == "netem" else None)
        )
        return Direction(
            direction,
            ns,
            dev,
            kind,
            rate,
            params.burst_bytes if params else None,
            limit,
            delay,
            tc.delay_applied(delay, netem),
            tuple(tuple(c) for c in commands),
        )

    def close(self) -> None:
        """Tears everything down (idempotent; safe from atexit and after a partial start)."""
        if self._state in ("new", "closing", "closed") or os.getpid() != self._owner:
            return
        self._state = "closing"
        try:
            destroy_namespaces(self.namespaces(), grace=self.grace)
        finally:
            self._state = "closed"
            atexit.unregister(self.close)
            pending = self._pending
            previous = self._restore_signals()
            if pending is not None:
                _pass_on(NetlabInterrupted(pending, previous.get(pending, signal.SIG_DFL)))

    # ---------------------------------------------------------------- signals

    def _install_signals(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        candidates = [signal.SIGTERM, signal.SIGHUP]
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # otherwise Python's KeyboardInterrupt already unwinds
            candidates.append(signal.SIGINT)
        for sig in candidates:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: leave it be
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self._state == "closing":
            self._pending = signum  # handed on once teardown is done
            return
        raise NetlabInterrupted(signum, self._previous.get(signum, signal.SIG_DFL))

    def _restore_signals(self) -> dict[int, Any]:
        previous, self._previous = self._previous, {}
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler)
        return previous

    # ---------------------------------------------------------------- reporting

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """{name: (bytes it sent, bytes it received)} over its link so far. A shaped direction reports
        what its qdisc metered (every frame after segmentation: headers and ACKs included); an
        unshaped one the bridge port's counters (which count a segmentation-offloaded burst's
        headers once)."""
        if self._state != "up":
            raise NetlabError("the lab is not up: no link counters to read")
        ip, tc_tool = _which("ip") or "ip", _which("tc") or "tc"
        ports = {
            entry["ifname"].split("@")[0]: entry.get("stats64", {})
            for entry in _json(_run([ip, "-n", self.bridge_ns, "-s", "-j", "link", "show"]).stdout)
        }
        down_qdiscs = _root_qdisc_bytes(_run([tc_tool, "-n", self.bridge_ns, "-s", "-j", "qdisc", "show"]).stdout)
        counts = {}
        for i, name in enumerate(self.names):
            port, link = f"v{i}", self.links[name]
            stats = ports.get(port, {})  # the port receives what the process sends, and the reverse
            sent, received = int(stats.get("rx", {}).get("bytes", 0)), int(stats.get("tx", {}).get("bytes", 0))
            if link.up.qdisc is not None:
                sent = _root_qdisc_bytes(
                    _run([tc_tool, "-n", link.netns, "-s", "-j", "qdisc", "show", "dev", "eth0"]).stdout, "eth0"
                ).get("eth0", sent)
            if link.down.qdisc is not None:
                received = down_qdiscs.get(port, received)
            counts[name] = (sent, received)
        return counts

    def summary(self) -> str:
        caps = self.capabilities or detect()
        lines = [
            f"netlab {self.tag}: {len(self.names)} namespaces on {self.network} (bridge in {self.bridge_ns}); {caps.summary()}"
        ]
        lines += [f"  {self.links[n].describe()}" for n in self.names if n in self.links]
        return "\n".join(lines)

    def report(self) -> dict:
        caps = self.capabilities or detect()
        return {
            "tag": self.tag,
            "subnet": str(self.network),
            "bridge_netns": self.bridge_ns,
            "capabilities": caps.to_dict(),
            "links": {n: self.links[n].to_dict() for n in self.names if n in self.links},
        }


def _json(text: str) -> list[dict]:
    try:
        return json.loads(text or "[]")
    except json.JSONDecodeError as e:
        raise NetlabError(f"iproute2 printed no JSON ({e}): it needs -j support (iproute2 >= 4.13)") from None


def _root_qdisc_bytes(text: str, device: str | None = None) -> dict[str, int]:
    """{device: bytes its root qdisc sent} from `tc -s -j qdisc show [dev DEVICE]` (which leaves
    the device out of its entries when it was named)."""
    return {q.get("dev", device): int(q.get("bytes", 0)) for q in _json(text) if q.get("root")}


def _pass_on(exc: NetlabInterrupted) -> None:
    """After teardown: give the signal to what was installed before (or die of it, as without us)."""
    previous = exc.previous
    if callable(previous) and previous is not signal.default_int_handler:
        previous(exc.signum, None)
    elif previous is signal.SIG_DFL:
        signal.signal(exc.signum, signal.SIG_DFL)
        os.kill(os.getpid(), exc.signum)
        time.sleep(1.0)  # the signal is delivered asynchronously; if it was blocked, fall through
