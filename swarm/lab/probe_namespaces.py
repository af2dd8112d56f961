"""The link probe across a lab's namespaces: a probe server (`python -m swarm.lab.probe serve`) in
each destination's namespace and one client in the source's, all started at once as subprocesses
through `NetLab.wrap`, so each transfer crosses the shaped links a run's traffic will.

    results = probe_netlab(net, "trainer", ["stage0", "stage3"], 4_000_000)   # {dst: [up, down]}
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from swarm.lab.probe import ADDRESS_MARK, ProbeResult


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.lab.probe", *args]


def _env() -> dict:
    """This checkout first on the path, so the subprocess imports the same swarm package."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


def _read_address(process: subprocess.Popen, deadline: float) -> str:
    """The first address line the server prints (its stdout is read on a thread)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("the probe server printed no address in time") from None
        if line is None:
            raise RuntimeError(f"the probe server exited with code {process.wait()}")
        if line.startswith(ADDRESS_MARK):
            return line[len(ADDRESS_MARK) :].strip()
        if time.monotonic() > deadline:
            raise TimeoutError("the probe server printed no address in time")


def probe_netlab(
    net,
    src: str,
    dsts: Sequence[str],
    nbytes: int,
    directions: Sequence[str] = ("up", "down"),
    timeout: float = 120.0,
    spawner=None,
) -> dict[str, list[ProbeResult]]:
    """A probe server in each of `dsts`' namespaces and one client in `src`'s, all started at once.

    "up" is src -> dst (src's up link and dst's down link), "down" is dst -> src. `net` is a started
    swarm.netlab.namespaces.NetLab (anything with .wrap(name, argv), .namespace(name) and
    .maddr(name) will do). A lab passes its `spawner` (swarm.lab.spawn): the processes then start
    without importing torch and hivemind again.
    """
    deadline = time.monotonic() + timeout

    def start(name: str, argv: list[str], **options) -> subprocess.Popen:
        if spawner is None:
            return subprocess.Popen(net.wrap(name, argv), **options)
        return spawner.popen(argv, net.namespace(name), **options)

    servers = {
        dst: start(
            dst,
            _python("serve", "--host", net.maddr(dst)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        for dst in dsts
    }
    client_argv = _python(
        "client", "--peers_from_stdin", "--bytes", str(nbytes), "--host", net.maddr(src), "--direction", *directions
    )
    client = start(
        src,
        client_argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        peers = {dst: _read_address(process, deadline) for dst, process in servers.items()}
        try:
            out, err = client.communicate(
                "".join(f"{m}\n" for m in peers.values()) + "\n", timeout=max(1.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the probe client in {src} did not finish within {timeout:.0f}s") from None
        if client.returncode != 0:
            raise RuntimeError(
                f"the probe client in {src} failed ({client.returncode}): {err.strip().splitlines()[-1] if err.strip() else 'no output'}"
            )
        by_peer = {m: d for d, m in peers.items()}
        results: dict[str, list[ProbeResult]] = {dst: [] for dst in dsts}
        for line in out.splitlines():
            if line.startswith("{"):
                result = ProbeResult.from_dict(json.loads(line))
                results[by_peer[result.peer]].append(result)
        return results
    finally:
        for process in [client, *servers.values()]:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            if process.stdin:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
