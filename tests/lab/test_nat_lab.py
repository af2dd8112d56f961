"""`python -m swarm lab --nat`: stage peers behind NAT routers (namespaces, iptables), started with
no flag about it, find out they cannot be dialed, get held by the bootstrap, are reached through
it, and the run keeps the single-process losses."""

from __future__ import annotations

import re
import subprocess
import sys

from _swarm_env import assert_losses_of_one_process, local_rows
from _util import REPO, SMOKE

from swarm.config import load_config
from swarm.training.results import read_results


def test_two_neighbouring_stages_behind_nat_are_relayed_and_keep_the_single_process_losses(tmp_path):
    results = tmp_path / "nat.jsonl"
    steps = 6
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "3", "--steps", str(steps)]
    command += ["--nat", "1,2", "--results", str(results), "--set", "train.eval_every=100"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    text = out.stdout
    for stage in (1, 2):
        assert re.search(rf"\[stage{stage}\]\s+behind NAT \(nobody can dial it, seen as /ip4/10\.77\.0\.\d+/", text), (
            text
        )
        reach = re.search(rf"\[stage{stage}\] stage {stage} reach: behind NAT; streams in: (.*); streams out", text)
        assert reach and "relayed" in reach[1], text[-3000:]  # its callers came through the relay
    assert re.search(r"\[stage0\]\s+reachable at /ip4/10\.77\.0\.3/tcp/\d+", text)
    # stage 1 cannot dial stage 2 (both behind NAT): its forward streams go through the bootstrap
    assert re.search(r"\[stage1\] stage 1 reach: .*streams out: .*\d+ relayed", text), text[-3000:]
    # peers.status, asked from the bootstrap's namespace before the peers stop, says it too
    for stage in (1, 2):
        assert re.search(rf"\[status\] \S+\s+{stage}/3 .* NAT via \w{{8}} \(in: .*relayed\)", text), text[-3000:]
    assert re.search(r"\[status\] \S+\s+0/3 .* direct ", text), text[-3000:]
    relayed = re.search(r"\[bootstrap\] bootstrap reach: .*relayed ([0-9.]+) MiB for 2 peer\(s\) behind NAT", text)
    assert relayed and float(relayed[1]) > 0, text[-3000:]
    ours = [r for r in read_results(results) if r["type"] == "step"]
    cfg = load_config(SMOKE, ["train.eval_every=100", "model.num_stages=3"])
    reference = [r for r in local_rows(cfg, tmp_path, steps=steps) if r["type"] == "step"]
    assert [r["step"] for r in ours] == list(range(1, steps + 1))
    assert [r["loss"] for r in ours] == [r["loss"] for r in reference]


def test_a_stage_whose_two_peers_are_behind_nat_loses_one_to_kill_9_and_keeps_the_losses(tmp_path):
    """Stage 1's first peer and a joiner (each behind its own NAT) split its micro-batches and sum
    their gradients through the relay (the replicas' all-reduce, relayed as the stage streams are);
    then the first is killed -9: the run goes on with the joiner and one process's losses."""
    results = tmp_path / "nat-churn.jsonl"
    steps, overrides = 60, ["train.epochs=100", "train.eval_every=1000"]
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "3", "--steps", str(steps)]
    command += ["--nat", "1", "--delay", "20ms", "--churn", "join:1@0,kill:1@step35", "--results", str(results)]
    command += [a for o in overrides for a in ("--set", o)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    text = out.stdout
    assert "stage1.2 is behind NAT at 192.168.2.2" in text
    assert re.search(r"\[stage1\.2\] .* joined with the state of step \d+", text), text[-3000:]
    assert "churn at" in text and "kill stage1\n" in text
    assert re.search(r"\[trainer\] .* stage 1: peer \w+ left the run", text), text[-3000:]
    assert re.search(r"\[status\] \S+\s+1/3 .* NAT via \w{8}", text), text[-3000:]
    assert_losses_of_one_process(results, SMOKE, [*overrides, "model.num_stages=3"], tmp_path, steps)


def test_nat_names_only_stages_and_the_trainer():
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "2", "--nat", "bootstrap"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --nat takes stage numbers (0..1) and 'trainer', got 'bootstrap'"
    )
