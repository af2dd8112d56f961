"""Helpers for one peer per container (docker/entrypoint.sh): shape my own interface, find the
bootstrap peer, answer health checks. Shaping uses the same tc commands as NetLab (swarm.netlab.tc).

    shape_interface(dev, rate=None, delay=None, ingress=False, netem="auto", shell=Shell()) -> ShapeResult
    clear_interface(dev, ingress=False, shell=Shell())      Shell(dry_run=False, out=print)
    ensure_identity(path) -> peer id (base58)          creates a libp2p RSA key file if missing
    bootstrap_maddr(identity_path, host, port, wait=120.0) -> "/ip4/<host's address>/tcp/<port>/p2p/<id>"
    port_open(port, host="127.0.0.1", timeout=2.0) -> bool

A container can only shape its own interface: `rate` limits its egress (tbf, or netem with a
delay when the kernel has it); `ingress=True` also limits what it receives through an ifb device
(needs the ifb, u32 and mirred kernel modules on the Docker host). When every container shapes its
egress, every transfer is already limited by its sender's rate.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarm.netlab import tc
from swarm.rates import format_delay, format_rate, parse_delay, parse_rate


@dataclass(frozen=True)
class ShapeResult:
    dev: str
    qdisc: str | None  # "tbf", "netem" or None
    rate_bits: int | None
    delay_s: float
    delay_applied: bool
    ingress: bool

    @property
    def delay_left(self) -> str:
        """The delay tc did not apply ('' when none), for the peer's in-process `--shape_delay`."""
        return format_delay(self.delay_s) if self.delay_s and not self.delay_applied else ""

    def describe(self) -> str:
        if self.qdisc is None and not self.delay_s:
            return f"{self.dev}: not shaped"
        egress = (
            "not rate-limited"
            if self.qdisc is None
            else f"{self.qdisc} {format_rate(self.rate_bits) if self.rate_bits else 'no rate limit'}"
        )
        text = f"{self.dev}: egress {egress}"
        if self.delay_s:
            text += (
                f", delay {format_delay(self.delay_s)}"
                if self.delay_applied
                else f", delay {format_delay(self.delay_s)} NOT applied (no netem)"
            )
        if self.ingress:
            text += f"; ingress tbf {format_rate(self.rate_bits)} via ifb"
        return text


@dataclass(frozen=True)
class Shell:
    """How the tc and ip commands run: each printed to `out` first, none run when `dry_run`."""

    dry_run: bool = False
    out: Callable[[str], None] = print


def _runner(shell: Shell) -> Callable[[list[str], bool], bool]:
    def run(argv: list[str], check: bool = True) -> bool:
        shell.out("+ " + shlex.join(argv))
        if shell.dry_run:
            return True
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0 and check:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"`{shlex.join(argv)}` failed: {why[0] if why else 'no error output'}")
        return done.returncode == 0

    return run


def shape_interface(
    dev: str,
    rate: str | int | None = None,
    delay: str | float | None = None,
    ingress: bool = False,
    netem: str = "auto",
    shell: Shell = Shell(),
    ifb: str = "ifb0",
) -> ShapeResult:
    """Shapes `dev`'s egress (and ingress). netem: "auto" tries netem when a delay is asked, "yes", "no"."""
    if netem not in ("auto", "yes", "no"):
        raise ValueError(f"bad netem choice {netem!r}: auto, yes or no")
    rate_bits = parse_rate(rate) if rate not in (None, "") else None
    delay_s = parse_delay(delay) if delay not in (None, "") else 0.0
    if ingress and rate_bits is None:
        raise ValueError("ingress shaping needs a rate")
    run, out = _runner(shell), shell.out
    use_netem = delay_s > 0 and netem != "no"
    commands = tc.egress_commands(dev, rate_bits, delay_s, netem=use_netem)
    applied_netem = False
    if use_netem:
        if shell.dry_run and netem == "auto":
            fallback = tc.egress_commands(dev, rate_bits, 0.0, netem=False)
            out(
                "# netem is tried first; if this kernel lacks it: "
                + "; ".join(shlex.join(c) for c in fallback)
                + " (the delay is not applied by tc: --delay-left)"
            )
        ok = run(commands[0], check=netem == "yes")
        applied_netem = ok
        if not ok:
            out(f"# netem is not available: delay {format_delay(delay_s)} not applied by tc, rate only (--delay-left)")
            commands = tc.egress_commands(dev, rate_bits, 0.0, netem=False)
        else:
            commands = []
    for argv in commands:
        run(argv)
    if ingress and rate_bits is not None:
        for argv in tc.ingress_commands(dev, ifb, rate_bits):
            run(argv, check=argv[:3] != ["ip", "link", "add"])  # the ifb may exist from a previous start
    kind = "netem" if applied_netem else ("tbf" if rate_bits is not None else None)
    return ShapeResult(dev, kind, rate_bits, delay_s, applied_netem, ingress)


def clear_interface(dev: str, ingress: bool = False, shell: Shell = Shell(), ifb: str = "ifb0") -> None:
    run = _runner(shell)
    for argv in tc.clear_commands(dev):
        run(argv, check=False)
    if ingress:
        run(["tc", "qdisc", "del", "dev", dev, "handle", "ffff:", "ingress"], check=False)
        run(["ip", "link", "del", ifb], check=False)


def ensure_identity(path: str | Path) -> str:
    """The peer id of the libp2p key in `path`, creating the key first if the file is missing."""
    # hivemind (and torch with it) only here: the netlab stays importable without them, and the
    # container's health check (`port-open`) and shaping start in a fraction of the time
    from hivemind.p2p import P2P, PeerID

    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return PeerID.from_identity(path.read_bytes()).to_base58()


def bootstrap_maddr(identity_path: str | Path, host: str, port: int, wait: float = 120.0) -> str:
    """The bootstrap peer's multiaddr from its key file (shared volume) and its host name."""
    deadline = time.monotonic() + wait
    path = Path(identity_path)
    while not (path.exists() and path.stat().st_size > 0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no bootstrap identity at {path} after {wait:.0f}s")
        time.sleep(0.5)
    while True:
        try:
            address = socket.gethostbyname(host)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cannot resolve {host!r}: {e}") from None
            time.sleep(0.5)
    return f"/ip4/{address}/tcp/{port}/p2p/{ensure_identity(path)}"


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
