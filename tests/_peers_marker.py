"""The `peers` marker: what `pytest -m "not peers"` (the quick loop) leaves out.

A test carries it when it starts a peer process: a p2p daemon (every hivemind node starts one),
hivepipe in a new interpreter (`python -m peers.*`, `python -m swarm ...`: a peer, a lab, a CLI run
as a user runs it) or a multiprocessing child (a flooding peer). It is set at collection for a test
that uses a fixture starting them (PEER_FIXTURES); a module whose tests start their own says
`pytestmark = pytest.mark.peers`, a test `@pytest.mark.peers`. An unmarked test that starts one all
the same fails at its teardown, naming the process: the quick loop cannot silently grow slow.

Also here, for pytest-xdist's `--dist loadgroup`: the tests of a module sharing a module-scoped
fixture are kept on one worker, so that the fixture is built once.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shlex
import subprocess
import sys

import pytest

MARK = "peers"
# fixtures that start peer processes (tests/conftest.py's in-process swarm: p2p daemons)
PEER_FIXTURES = frozenset({"swarm"})
MODULES = frozenset({"peers", "swarm"})  # hivepipe's own, as `python -m MODULE`
PROGRAMS = frozenset({"p2pd", "hivepipe"})


def _started(args) -> str | None:
    """The command line of the peer process `args` starts, or None for an ordinary tool (git, tc, ip)."""
    if isinstance(args, str):
        words = shlex.split(args)
    elif isinstance(args, bytes | os.PathLike):
        words = [os.fsdecode(args)]
    else:
        words = [os.fsdecode(w) for w in args]
    names = [os.path.basename(w) for w in words]
    python = [i for i, n in enumerate(names) if n.startswith("python") or words[i] == sys.executable]
    ours = any(
        words[i + 1 : i + 3][:1] == ["-m"] and words[i + 2].split(".")[0] in MODULES
        for i in python
        if i + 2 < len(words)
    )
    if ours or any(n in PROGRAMS for n in names):
        return " ".join(words)
    return None


class Watch:
    """Records the peer processes started from when an unmarked test's setup begins until its
    teardown ends (module-scoped fixtures it sets up or tears down included)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.armed = False

    def install(self) -> None:
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start
        watch = self

        def recording_popen(popen, args, *more, **kwargs):
            if watch.armed and (command := _started(args)):
                watch.started.append(command)
            popen_init(popen, args, *more, **kwargs)

        def recording_start(process):
            if watch.armed:
                watch.started.append(f"multiprocessing child {process.name}")
            process_start(process)

        subprocess.Popen.__init__ = recording_popen
        multiprocessing.process.BaseProcess.start = recording_start
        self._watch_daemons()

    def _watch_daemons(self) -> None:
        """hivemind starts its p2p daemon with asyncio's subprocess API, which on uvloop (the
        swarm's loops) spawns without subprocess.Popen: its P2P.create is watched instead."""
        from hivemind.p2p import P2P

        create = P2P.create.__func__
        watch = self

        async def recording_create(cls, *args, **kwargs):
            if watch.armed:
                watch.started.append("a p2p daemon (hivemind's P2P.create)")
            return await create(cls, *args, **kwargs)

        P2P.create = classmethod(recording_create)

    def arm(self, item) -> None:
        self.started.clear()
        self.armed = item.get_closest_marker(MARK) is None

    def disarm(self) -> list[str]:
        self.armed = False
        return list(self.started)


WATCH = Watch()


def fail_if_started(item, started: list[str]) -> None:
    if started:
        pytest.fail(
            f"{item.nodeid} starts a peer process ({'; '.join(started[:3])}) but is not marked `{MARK}`: "
            f"mark it (tests/_peers_marker.py) so that `pytest -m 'not {MARK}'` stays the quick loop",
            pytrace=False,
        )


def mark_collected(items) -> None:
    """`peers` on the tests using PEER_FIXTURES; one xdist group for the tests of a module that
    share a module-scoped fixture (unless they name a group of their own)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & PEER_FIXTURES:
            item.add_marker(MARK)
        if item.get_closest_marker("xdist_group") is None and _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _shares_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())
