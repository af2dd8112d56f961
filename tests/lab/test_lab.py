"""`python -m swarm lab`: a swarm of separate processes on this machine, shaped or not, equals one process."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from _swarm_env import Finished, assert_losses_of_one_process, assert_same_run, local_rows, run_tagged
from _util import REPO, SMOKE, cli_here

from swarm.config import load_config
from swarm.lab.plan import RunOptions, RunPlan, parse_replicas
from swarm.netlab.namespaces import list_namespaces
from swarm.training.results import read_results

SHAPED = ["--bandwidth", "stage1=20mbit,*=50mbit", "--delay", "5ms"]


def _lab(*args: str, timeout: float) -> Finished:
    """`python -m swarm lab` on the smoke config, two stages, two steps, and `args`."""
    command = [sys.executable, "-m", "swarm", "lab", str(SMOKE), "--stages", "2", "--steps", "2", *args]
    return run_tagged(command, timeout=timeout, cwd=REPO)


@pytest.mark.peers
def test_lab_runs_separate_processes_shaped_in_process_and_matches_single_process(tmp_path):
    """Two stage peers and a trainer, each process pacing what it sends (the shaping a user without
    root gets); checkpoints, the stages' compute rows, and the single-process losses. (The lab
    without shaping: tests/lab/test_lab_models.py; in namespaces: the test below.)"""
    results = tmp_path / "lab.jsonl"
    overrides = ["compression.forward=topk:0.1+ef21", "compression.backward=topk:reuse", "train.eval_every=100"]
    sets = [a for o in overrides for a in ("--set", o)]
    finished = _lab(
        "--results",
        str(results),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--checkpoint_every",
        "1",
        *SHAPED,
        "--shaping",
        "inprocess",
        *sets,
        timeout=150,
    )
    out = finished.done
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[stage0]" in out.stdout and "[stage1]" in out.stdout and "[trainer] step 2" in out.stdout
    # the run over, its peers leave at once when the lab stops them: no hint to press Ctrl-C again
    assert "Ctrl-C again" not in out.stdout, out.stdout[-3000:]
    assert "in-process shaping: bootstrap 50mbit, stage0 50mbit, stage1 20mbit, trainer 50mbit; delay 5ms" in out.stdout
    probe = re.search(r"\[lab\] probe trainer<->stage1: up ([0-9.]+) Mbit/s, down ([0-9.]+) Mbit/s", out.stdout)
    # up: the trainer's 50mbit shaper, down: stage1's 20mbit (each caps its direction; how close a
    # probe comes to its cap depends on the machine's load, which the throughput benchmark reports)
    assert probe and 0 < float(probe[1]) <= 55 and 0 < float(probe[2]) <= 22
    _peers_worked(results)
    cfg = load_config(SMOKE, [*overrides, "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))
    assert sorted(p.name for p in (tmp_path / "ck" / "step-00000002").iterdir()) == [
        "experiment.json",  # the run's config: what python -m swarm export rebuilds the model from
        "stage0.pt",
        "stage1.pt",
        "trainer.pt",
    ]
    (stages,) = [r for r in read_results(results) if r["type"] == "stages"]  # what the throughput benchmark reads
    assert sorted(s["stage"] for s in stages["stages"]) == [0, 1] and all(
        s["compute_s"] > 0 and s["samples"] == 2 * 40 for s in stages["stages"]
    )
    # the computing thread's CPU time, one torch thread
    assert all(0 < s["compute_cpu_s"] < 2 * s["compute_s"] for s in stages["stages"])
    steps = [r for r in read_results(results) if r["type"] == "step"]  # each carries the stages' compute so far
    assert [sorted((p["stage"], p["samples"]) for p in r["stages"]) for r in steps] == [
        [(0, 40), (1, 40)],
        [(0, 80), (1, 80)],
    ]
    assert all(
        0 < p["compute_s"] <= q["compute_s"] for p, q in zip(steps[0]["stages"], steps[1]["stages"], strict=True)
    )
    threads = max(1, len(os.sched_getaffinity(0)) // 3)  # two stage peers and the trainer share the cores
    assert f"[lab] torch threads per peer: {threads}" in out.stdout
    assert finished.daemons_left == 0  # every daemon the lab started is gone


def _peers_worked(results) -> None:
    """Each peer and its p2p daemon used CPU while the lab metered them."""
    meter = next(r for r in read_results(results) if r["type"] == "meter")["samples"]
    used = {
        name: [meter[-1]["cpu"][name][i] - meter[0]["cpu"][name][i] for i in (0, 1)]
        for name in ("stage0", "stage1", "trainer")
    }
    assert all(own > 0 and daemon > 0 for own, daemon in used.values()), used


@pytest.mark.peers
def test_lab_in_namespaces_reports_its_links_and_keeps_the_numerics(tmp_path):
    """... and writes the run's timeline: every peer's spans, clocks aligned (one machine's: within
    a few milliseconds of each other)."""
    results = tmp_path / "shaped.jsonl"
    finished = _lab(
        "--results",
        str(results),
        *SHAPED,
        "--shaping",
        "netns",
        "--set",
        "train.eval_every=100",
        "--trace",
        str(tmp_path / "run.json"),
        timeout=200,
    )
    out = finished.done
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "stage1     10.77.0.4       up tbf 20mbit" in out.stdout
        and "trainer    10.77.0.5       up tbf 50mbit" in out.stdout
    )
    probe = re.search(r"probe trainer<->stage1: up ([0-9.]+) Mbit/s, down ([0-9.]+) Mbit/s", out.stdout)
    assert probe and all(5 < float(v) <= 20.5 for v in probe.groups())  # the 20mbit link binds
    assert re.search(r"probe trainer<->bootstrap: up [0-9.]+ Mbit/s", out.stdout)  # every access link is crossed
    assert list_namespaces(f"hp-{finished.pid}-") == []  # all torn down (the lab's, named after its pid)
    rows = read_results(results)
    meter = next(r for r in rows if r["type"] == "meter")["samples"]
    counted = {
        name: [meter[-1]["links"][name][i] - meter[0]["links"][name][i] for i in (0, 1)]
        for name in ("stage0", "stage1")
    }
    payload = {
        d: sum(r["bytes"].get(f"boundary0.{d}.train", 0) for r in rows if r["type"] == "step")
        for d in ("forward", "backward")
    }
    assert payload["forward"] > 0 and payload["backward"] > 0
    # what each link's qdisc metered covers the payload that crossed it, headers on top
    assert counted["stage0"][0] > payload["forward"] and counted["stage1"][1] > payload["forward"]
    assert counted["stage1"][0] > payload["backward"] and counted["stage0"][1] > payload["backward"]
    assert all(later["at"] > earlier["at"] for earlier, later in zip(meter, meter[1:], strict=False))
    _peers_worked(results)
    cfg = load_config(SMOKE, ["train.eval_every=100", "model.num_stages=2"])
    assert_same_run(read_results(results), local_rows(cfg, tmp_path, steps=2))
    trace = json.loads((tmp_path / "run.json").read_text())
    assert [p.split()[0] for p in trace["otherData"]["processes"]] == ["trainer", "stage0", "stage1"]
    assert all(abs(ms) < 20 for ms in trace["otherData"]["offsets_ms"].values())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    forwards = {e["args"]["mb"] for e in spans if e["name"] == "forward" and e["pid"] == 3}
    assert forwards >= {f"train/{step}/{i}" for step in (0, 1) for i in range(cfg.train.micro_batches)}
    assert {"send", "receive", "awaiting reply", "encode", "decode"} <= {e["name"] for e in spans}
    assert "share of the time each peer spent" in out.stdout and "[lab]   stage1" in out.stdout


@pytest.mark.peers
def test_lab_with_two_replicas_of_a_stage_from_the_start_keeps_one_process_bit_for_bit(tmp_path):
    """`--replicas 1=2`: stage 1's second peer starts with the others, as a volunteer would (the
    run's config from the swarm), in its own process; the trainer sets both up, the micro-batches
    spread over them, and their exact sums (swarm.engine.exactsum) keep every loss one process's."""
    results = tmp_path / "replicas.jsonl"
    overrides = ["train.eval_every=100"]
    finished = _lab("--replicas", "1=2", "--results", str(results), "--set", overrides[0], timeout=150)
    out = finished.done
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[trainer] run '" in out.stdout and "stage 0: 1 peer(s), stage 1: 2 peer(s)" in out.stdout, out.stdout
    assert "Ctrl-C again" not in out.stdout, out.stdout[-3000:]  # a replica, too, leaves an ended run at once
    (stages,) = [r for r in read_results(results) if r["type"] == "stages"]
    ran = sorted((s["stage"], s["samples"] > 0) for s in stages["stages"])
    assert ran == [(0, True), (1, True), (1, True)], stages  # both replicas of stage 1 ran micro-batches
    assert sum(s["samples"] for s in stages["stages"] if s["stage"] == 1) == 2 * 40  # two steps of 40
    assert_losses_of_one_process(results, SMOKE, [*overrides, "model.num_stages=2"], tmp_path, 2, stage_peers=3)
    assert finished.daemons_left == 0


@pytest.mark.parametrize(
    "args, error",
    [
        (["--snapshot_every", "-1"], "--snapshot_every: expected 0 (none) or a positive number of steps, got '-1'"),
        (["--checkpoint_every", "2"], "error: --checkpoint_every needs --checkpoint_dir"),
        (["--shaping", "tc"], "--shaping: invalid choice: 'tc' (choose from 'netns', 'inprocess')"),
        (["--nat", "bootstrap"], "error: --nat takes stage numbers (0..1) and 'trainer', got 'bootstrap'"),
        (
            ["--set", "train.in_flight=65"],
            "takes at most 64 micro-batches of one sender at once (max_requests_per_sender)",
        ),
        (["--replicas", "0"], "error: --replicas: a stage needs at least one peer, got '0'"),
        (["--replicas", "1=0"], "error: --replicas: a stage needs at least one peer, got '1=0'"),
        (["--replicas", "2=3"], "error: --replicas names stage 2, the run has stages 0..1"),
        (
            ["--replicas", "1=two"],
            "error: --replicas takes a count for every stage (3) or STAGE=COUNT pairs (1=3,2=2), got '1=two'",
        ),
        (
            ["--replicas", "1=2,"],
            "error: --replicas takes a count for every stage (3) or STAGE=COUNT pairs (1=3,2=2), got ''",
        ),
        (
            ["--replicas", "x=2"],
            "error: --replicas takes a count for every stage (3) or STAGE=COUNT pairs (1=3,2=2), got 'x=2'",
        ),
        # found on the meta device, before the peers start (each used to build the model to find it)
        (["--stages", "9"], "error: digits_cnn: 4 blocks can be split into 1..4 stages, not 9"),
    ],
)
def test_the_lab_refuses_bad_options_before_any_peer_starts(capsys, args, error):
    done = cli_here(capsys, "lab", str(SMOKE), "--stages", "2", *args)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(error), done.stderr
    assert done.stdout == "" and "[bootstrap]" not in done.stderr  # no process started


def test_replicas_name_every_stage_peer_and_share_the_cores():
    """`--replicas 3` gives every stage three peers, `1=3,0=2` those stages (the others one), each
    its own process named after its stage, as the churn's joiners are (stage1.2, stage1.3)."""
    assert parse_replicas(None, 3) == {0: 1, 1: 1, 2: 1}
    assert parse_replicas("3", 2) == {0: 3, 1: 3}
    assert parse_replicas(" 1=3, 0=2 ", 3) == {0: 2, 1: 3, 2: 1}
    plan = RunPlan.of(str(SMOKE), 3, RunOptions(replicas="1=3,2=2", churn="join:1@0,join:0@5"))
    assert plan.replica_names() == [(1, "stage1.2"), (1, "stage1.3"), (2, "stage2.2")]
    assert plan.threads == max(1, len(os.sched_getaffinity(0)) // 7)  # six stage peers and the trainer
    assert plan.churn.joiners(plan.replicas) == ["stage1.4", "stage0.2"]  # numbered on after the replicas
