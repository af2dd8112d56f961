"""The `peers` marker's check (tests/_peers_marker.py): which processes count as peers, and the
failure an unmarked test that starts one gets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _peers_marker import WATCH, _started, fail_if_started


def test_daemons_and_hivepipe_in_a_new_interpreter_are_peers_other_tools_are_not():
    daemon = "/x/hivemind_cli/p2pd -listen=/unix/tmp/p.sock"
    assert _started(daemon.split()) == daemon
    for argv in (
        [sys.executable, "-m", "peers.stage", "--stage", "0"],
        ["python3", "-m", "swarm", "lab", "configs/smoke.yaml"],
        ["ip", "netns", "exec", "hp-1-ab-stage0", sys.executable, "-m", "swarm.lab.probe", "serve"],
        "hivepipe run configs/smoke.yaml",
    ):
        assert _started(argv), argv
    for argv in (["git", "rev-parse", "HEAD"], [sys.executable, "configs/study-cpu/generate.py"], "tc qdisc show"):
        assert _started(argv) is None, argv


def test_an_unmarked_test_that_started_a_peer_fails_naming_it(request):
    with pytest.raises(
        pytest.fail.Exception, match=r"starts a peer process \(python -m peers.stage\) but is not marked"
    ):
        fail_if_started(request.node, ["python -m peers.stage"])
    fail_if_started(request.node, [])  # nothing started: nothing to say


def test_the_watch_sees_what_this_test_starts_and_leaves_ordinary_tools_alone():
    assert WATCH.armed  # this test is not marked: its processes are watched
    subprocess.run(["true"], check=True)
    assert WATCH.started == []
