"""`python -m swarm lab --nat`: stage peers behind NAT routers (namespaces, iptables), started with
no flag about it, find out they cannot be dialed, get held by the bootstrap, are reached through
it, and the run keeps the single-process losses."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from _swarm_env import assert_losses_of_one_process, one_process_meanwhile
from _util import REPO, SMOKE, ensure_iptables

pytestmark = pytest.mark.peers  # every test here starts peer processes (tests/_peers_marker.py)


def test_stages_behind_nat_are_relayed_and_a_replica_behind_nat_killed_9_keeps_the_losses(tmp_path):
    """Stages 1 and 2 behind NAT routers (namespaces, iptables), started with no flag about it: they
    find out nobody can dial them and are reached through the bootstrap, and stage 1 cannot dial
    stage 2 either (its forward streams are relayed). Stage 1's first peer and a joiner, each behind
    its own NAT, split its micro-batches and sum their gradients through the relay (the replicas'
    all-reduce, relayed as the stage streams are); then the first is killed -9: the run goes on with
    the joiner and one process's losses. One lab run for all of it (the suite's time)."""
    ensure_iptables()
    results = tmp_path / "nat.jsonl"
    # the joiner's process forks from the lab's spawner (swarm.lab.spawn) and joins within about 15
    # steps under load; the kill waits for it to join (an event) in any case
    steps, overrides = 40, ["train.epochs=100", "train.eval_every=1000"]
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "3", "--steps", str(steps)]
    command += ["--nat", "1,2", "--delay", "20ms", "--churn", "join:1@0,kill:1@step20", "--results", str(results)]
    command += [a for o in overrides for a in ("--set", o)]
    reference = one_process_meanwhile(SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps)
    out = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    text = out.stdout
    for stage in (1, 2):
        assert re.search(rf"\[stage{stage}\]\s+behind NAT \(nobody can dial it, seen as /ip4/10\.77\.0\.\d+/", text), (
            text
        )
    assert re.search(r"\[stage0\]\s+reachable at /ip4/10\.77\.0\.3/tcp/\d+", text)
    # the peers that live to the end say how they were reached: their callers came through the relay,
    # and stage 1's joiner cannot dial stage 2 (both behind NAT): its forward streams are relayed too
    reach = re.search(r"\[stage2\] stage 2 reach: behind NAT; streams in: (.*); streams out", text)
    assert reach and "relayed" in reach[1], text[-3000:]
    assert re.search(
        r"\[stage1\.2\] stage 1 reach: behind NAT; streams in: .*relayed.*streams out: .*\d+ relayed", text
    ), text[-3000:]
    assert re.search(r"stage1\.2 is behind NAT at 192\.168\.\d+\.2", text), text[-3000:]
    assert re.search(r"\[stage1\.2\] .* joined with the state of step \d+", text), text[-3000:]
    assert "churn at" in text and "kill stage1\n" in text
    assert re.search(r"\[trainer\] .* stage 1: peer \w+ left the run", text), text[-3000:]
    # peers.status, asked from the bootstrap's namespace before the peers stop, says it too
    for stage in (1, 2):
        assert re.search(rf"\[status\] \S+\s+{stage}/3 .* NAT via \w{{8}} \(in: .*relayed\)", text), text[-3000:]
    assert re.search(r"\[status\] \S+\s+0/3 .* direct ", text), text[-3000:]
    relayed = re.search(r"\[bootstrap\] bootstrap reach: .*relayed ([0-9.]+) MiB for (\d) peer\(s\) behind NAT", text)
    assert relayed and float(relayed[1]) > 0 and int(relayed[2]) >= 2, text[-3000:]
    assert_losses_of_one_process(
        results, SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps, reference=reference
    )
