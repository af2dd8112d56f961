"""What this machine's kernel and tools allow for the namespace lab, and namespace cleanup.

    detect(refresh=False) -> Capabilities   root/ip/tc/netns/veth/bridge/tbf/netem/ifb, probed once
                                             per process in a throwaway namespace
    require() -> Capabilities                or NetlabError (one line) when namespaces can't work
    list_namespaces(prefix=None), destroy_namespaces(names, grace), cleanup_stale(prefix="hp")
    find_tool("ip"), run_tool(argv, check=True)   the tools, run with a deadline and one-line errors
    NetlabError(RuntimeError): one-line, user-facing; NetlabInterrupted(KeyboardInterrupt)

swarm.netlab.namespaces builds labs on top of this (and re-exports the public names).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "hp"
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_TIMEOUT = 30.0


class NetlabError(RuntimeError):
    """Namespaces or shaping cannot be set up here; the message is one line meant for the user."""


class NetlabInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a NetLab was up (raised so the stack unwinds and cleans up)."""

    def __init__(self, signum: int, previous: Any = signal.SIG_DFL) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.previous = signum, previous


# ---------------------------------------------------------------------------------------- running


def find_tool(tool: str) -> str | None:
    """The path of `ip` or `tc`, also where sbin is not on PATH (a non-login root shell)."""
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(_SBIN))


def _first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else "no error output"


def run_tool(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs `ip` or `tc` with a deadline; a failure (with `check`) is a one-line NetlabError."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT)
    except FileNotFoundError as e:
        raise NetlabError(f"{argv[0]} not found: install iproute2 (ip, tc)") from e
    except subprocess.TimeoutExpired as e:
        raise NetlabError(f"`{' '.join(argv)}` did not finish within {_TIMEOUT:.0f}s") from e
    if check and done.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed: {_first_line(done.stderr or done.stdout)}")
    return done


# -------------------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class Capabilities:
    """What this machine offers, probed in a throwaway namespace (nothing touches the host)."""

    root: bool
    ip: str | None
    tc: str | None
    netns: bool = False
    veth: bool = False
    bridge: bool = False
    tbf: bool = False
    netem: bool = False
    ifb: bool = False
    kernel: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # feature -> why it is missing

    def problem(self) -> str | None:
        """Why namespaces with shaping cannot work here (one line), or None."""
        if not self.root:
            return (
                "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN): run as root or use in-process shaping"
            )
        if not self.ip or not self.tc:
            missing = " and ".join(t for t, path in (("ip", self.ip), ("tc", self.tc)) if not path)
            return f"{missing} not found: install iproute2, or use in-process shaping"
        for feature in ("netns", "veth", "bridge", "tbf"):
            if not getattr(self, feature):
                return (
                    f"the kernel refused {feature}: {self.errors.get(feature, 'unknown error')}; use in-process shaping"
                )
        return None

    def summary(self) -> str:
        flags = " ".join(
            f"{f}={'yes' if getattr(self, f) else 'no'}" for f in ("netns", "veth", "bridge", "tbf", "netem", "ifb")
        )
        who = "root" if self.root else f"uid {os.geteuid()}"
        line = f"kernel {self.kernel} ({who}): {flags}"
        if not self.netem and self.root and self.ip and self.tc and self.netns:
            line += "; no netem: delays must be added in-process"
        return line

    def to_dict(self) -> dict:
        return asdict(self)


_detected: Capabilities | None = None
_detect_lock = threading.Lock()


def detect(refresh: bool = False, prefix: str = PREFIX) -> Capabilities:
    """Probes root, ip, tc, and the kernel's netns/veth/bridge/tbf/netem/ifb support (cached)."""
    global _detected
    with _detect_lock:
        if _detected is not None and not refresh:
            return _detected
        ip, tc_path = find_tool("ip"), find_tool("tc")
        caps: dict[str, Any] = {
            "root": os.geteuid() == 0,
            "ip": ip,
            "tc": tc_path,
            "kernel": os.uname().release,
            "errors": {},
        }
        if caps["root"] and ip and tc_path:
            _probe_kernel(ip, tc_path, caps, prefix)
        _detected = Capabilities(**caps)
        return _detected


def _probe_kernel(ip: str, tc_path: str, caps: dict[str, Any], prefix: str) -> None:
    ns = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}--probe"
    errors: dict[str, str] = caps["errors"]

    def attempt(feature: str, *argv: str) -> bool:
        done = run_tool(argv, check=False)
        if done.returncode != 0:
            errors[feature] = _first_line(done.stderr or done.stdout)
        return done.returncode == 0

    if not attempt("netns", ip, "netns", "add", ns):
        return
    try:
        caps["netns"] = attempt("netns", ip, "-n", ns, "link", "set", "lo", "up")
        caps["veth"] = attempt("veth", ip, "-n", ns, "link", "add", "hpa", "type", "veth", "peer", "name", "hpb")
        caps["bridge"] = attempt("bridge", ip, "-n", ns, "link", "add", "hpbr", "type", "bridge")
        caps["ifb"] = attempt("ifb", ip, "-n", ns, "link", "add", "hpifb", "type", "ifb")
        caps["netem"] = attempt(
            "netem", tc_path, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", "rate", "1gbit"
        )
        if caps["netem"]:
            run_tool([tc_path, "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        caps["tbf"] = attempt(
            "tbf",
            tc_path,
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            "1gbit",
            "burst",
            "100000",
            "limit",
            "100000",
        )
    finally:
        run_tool([ip, "netns", "del", ns], check=False)


def require() -> Capabilities:
    """The capabilities, or NetlabError with a one-line reason when namespaces cannot be used."""
    caps = detect()
    problem = caps.problem()
    if problem:
        raise NetlabError(problem)
    return caps


# -------------------------------------------------------------------------------------- namespaces


def list_namespaces(prefix: str | None = None) -> list[str]:
    """Names in `ip netns list` (optionally only those starting with `prefix`)."""
    try:
        names = sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        names = []
    except OSError:
        ip = find_tool("ip") or "ip"
        names = [line.split()[0] for line in run_tool([ip, "netns", "list"]).stdout.splitlines() if line.strip()]
    return [n for n in names if prefix is None or n.startswith(prefix)]


def _pids_in(ns: str) -> list[int]:
    done = run_tool([find_tool("ip") or "ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def destroy_namespaces(namespaces: Sequence[str], grace: float = 2.0) -> list[str]:
    """Kills every process inside (SIGTERM, then SIGKILL after `grace` s) and deletes the namespaces."""
    ip = find_tool("ip") or "ip"
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = {ns: _pids_in(ns) for ns in namespaces}
        if not any(pids.values()):
            break
        for found in pids.values():
            for pid in found:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pids_in(ns) for ns in namespaces):
            time.sleep(0.05)
    deleted = []
    for ns in namespaces:
        if run_tool([ip, "netns", "del", ns], check=False).returncode == 0:
            deleted.append(ns)
    return deleted


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes namespaces `<prefix>-<pid>-...` whose owner pid is dead (left by a crashed run)."""
    owner = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-")
    stale = [ns for ns in list_namespaces(prefix + "-") if (m := owner.match(ns)) and not pid_alive(int(m.group(1)))]
    return destroy_namespaces(stale, grace=0.5) if stale else []
