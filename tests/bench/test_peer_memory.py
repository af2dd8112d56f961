"""swarm.bench.peer_memory: a peer's memory and its p2p daemon's, counted under the command that
started them (a stand-in peer: a process whose command line names peers.stage, leading its group,
and a daemon named p2pd in that group)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from swarm.bench.peer_memory import memory_of, sample


def test_a_peer_and_its_daemon_are_counted_under_the_command_that_started_them(tmp_path):
    daemon = tmp_path / "p2pd"
    shutil.copy(shutil.which("sleep"), daemon)
    code = f"import subprocess, sys; d = subprocess.Popen([{str(daemon)!r}, '60']); print(d.pid, flush=True); sys.stdin.read()"
    peer = subprocess.Popen(
        [sys.executable, "-c", code, "peers.stage", "--stage", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        daemon_pid = int(peer.stdout.readline())
        found = sample(os.getpid())
        assert list(found) == [f"stage3 {peer.pid}"], found
        own, its_daemon = found[f"stage3 {peer.pid}"]["peer"], found[f"stage3 {peer.pid}"]["daemon"]
        assert own.rss >= own.pss > 0 and own.private > 0
        assert its_daemon.rss > 0 and its_daemon.rss == memory_of(daemon_pid).rss
        assert sample(daemon_pid) == {}  # the peer does not descend from it: another swarm's
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()
    assert memory_of(peer.pid) is None  # gone
